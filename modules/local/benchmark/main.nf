/*
 * BENCHMARK: Score the embeddings of one .h5ad with the scIB metrics.
 * Runs `scfoundry benchmark` once; task.ext.args (conf/modules.config) adds method options.
 */
process BENCHMARK {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_medium'

    input:
    tuple val(meta), path(h5ad)

    output:
    tuple val(meta), path("${meta.id}.benchmark.csv"), emit: metrics
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} benchmark \\
        --data ${h5ad} \\
        --label-key ${params.label_key} \\
        --batch-key ${params.batch_key} \\
        --out ${meta.id}.benchmark.csv \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    touch ${meta.id}.benchmark.csv

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
