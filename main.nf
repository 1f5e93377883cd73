#!/usr/bin/env nextflow
/*
 * scfoundry as a Nextflow pipeline: each task runs the `scfoundry` binary once.
 *
 *   nextflow run main.nf -profile docker,gpu --task embed --method scgpt --input 'data/*.h5ad'
 *   nextflow run main.nf -profile slurm --task transfer --method uce --reference ref.h5ad --query q.h5ad
 *
 * The workflow is in workflows/scfoundry.nf, one module per task in modules/local/<task>/main.nf;
 * parameters are documented in nextflow_schema.json, profiles in nextflow.config.
 * `scfoundry embed ... --executor nextflow` runs this pipeline with a config it generates.
 */

nextflow.enable.dsl = 2

include { SCFOUNDRY } from './workflows/scfoundry'

workflow {
    SCFOUNDRY ()
}
