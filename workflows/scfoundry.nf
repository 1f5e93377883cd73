/*
 * The scfoundry workflow: one branch per task kind (params.task).
 * Inputs are .h5ad files; every process runs `params.scfoundry` (the binary) for one task.
 */

include { EMBED                    } from '../modules/local/embed/main'
include { EMBED as EMBED_REFERENCE } from '../modules/local/embed/main'
include { EMBED as EMBED_QUERY     } from '../modules/local/embed/main'
include { TRANSFER                 } from '../modules/local/transfer/main'
include { FINETUNE                 } from '../modules/local/finetune/main'
include { INTEGRATE                } from '../modules/local/integrate/main'
include { BENCHMARK                } from '../modules/local/benchmark/main'
include { GEOMETRY                 } from '../modules/local/geometry/main'

/* [meta, file] for each .h5ad matched by a path or glob; meta.id is the file's stem. */
def h5ad_channel(pattern, role) {
    return Channel
        .fromPath(pattern, checkIfExists: true)
        .map { f -> [ [ id: f.baseName, role: role ], f ] }
}

def require_param(name) {
    if (params[name] == null || params[name] == '') {
        error "--${name} is required for --task ${params.task} (see nextflow_schema.json)"
    }
}

workflow SCFOUNDRY {

    main:
    ch_versions = Channel.empty()
    def task_kind = params.task

    if (task_kind == 'embed') {
        require_param('input')
        EMBED ( h5ad_channel(params.input, 'data'), params.method )
        ch_versions = ch_versions.mix(EMBED.out.versions)

    } else if (task_kind == 'transfer') {
        require_param('reference')
        require_param('query')
        require_param('label_key')
        ch_reference = h5ad_channel(params.reference, 'reference')
        ch_query     = h5ad_channel(params.query, 'query')
        def pair_id = { ref_meta, query_meta -> [ id: "${query_meta.id}_from_${ref_meta.id}" ] }
        if (params.method == 'pca') {
            // pca is fitted on the reference and the query projected with that fit: one task
            ch_pairs = ch_reference
                .combine(ch_query)
                .map { ref_meta, ref, query_meta, query -> [ pair_id(ref_meta, query_meta), ref, query ] }
            TRANSFER ( ch_pairs, params.method, '' )
        } else {
            // a model that embeds each cell on its own: the reference and the query are
            // embedded by two concurrent tasks, and the vote uses their obsm['X_<method>']
            EMBED_REFERENCE ( ch_reference, params.method )
            EMBED_QUERY     ( ch_query, params.method )
            ch_pairs = EMBED_REFERENCE.out.h5ad
                .combine(EMBED_QUERY.out.h5ad)
                .map { ref_meta, ref, query_meta, query -> [ pair_id(ref_meta, query_meta), ref, query ] }
            TRANSFER ( ch_pairs, params.method, "X_${params.method}" )
            ch_versions = ch_versions.mix(EMBED_REFERENCE.out.versions, EMBED_QUERY.out.versions)
        }
        ch_versions = ch_versions.mix(TRANSFER.out.versions)

    } else if (task_kind == 'finetune') {
        require_param('input')
        FINETUNE ( h5ad_channel(params.input, 'data'), params.method )
        ch_versions = ch_versions.mix(FINETUNE.out.versions)

    } else if (task_kind == 'integrate') {
        require_param('input')
        INTEGRATE ( h5ad_channel(params.input, 'data'), params.method )
        ch_versions = ch_versions.mix(INTEGRATE.out.versions)

    } else if (task_kind == 'benchmark') {
        require_param('input')
        require_param('embedding')
        BENCHMARK ( h5ad_channel(params.input, 'data') )
        ch_versions = ch_versions.mix(BENCHMARK.out.versions)

    } else if (task_kind == 'geometry') {
        require_param('input')
        require_param('embedding')
        GEOMETRY ( h5ad_channel(params.input, 'data') )
        ch_versions = ch_versions.mix(GEOMETRY.out.versions)

    } else {
        error "unknown --task '${task_kind}': use embed, transfer, finetune, integrate, benchmark or geometry"
    }

    ch_versions
        .unique()
        .collectFile(name: 'scfoundry_versions.yml', storeDir: "${params.outdir}/pipeline_info")

    emit:
    versions = ch_versions
}
