/*
 * BENCHMARK: Score the embeddings (params.embedding, comma-separated obsm keys) of one .h5ad with
 * the scIB metrics; the results folder holds results.tsv, results.json and the figure.
 * Runs `scfoundry benchmark` once; task.ext.args (conf/modules.config) adds metric options.
 */
process BENCHMARK {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_medium'

    input:
    tuple val(meta), path(h5ad)

    output:
    tuple val(meta), path("${meta.id}.benchmark"), emit: results
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} benchmark \\
        --data ${h5ad} \\
        --embedding ${params.embedding} \\
        --label-key ${params.label_key} \\
        --batch-key ${params.batch_key} \\
        --seed ${params.seed} \\
        --out ${meta.id}.benchmark \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    mkdir -p ${meta.id}.benchmark
    touch ${meta.id}.benchmark/results.tsv ${meta.id}.benchmark/results.json

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
