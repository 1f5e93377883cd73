/*
 * INTEGRATE: Integrate the batches of one .h5ad (harmony on an embedding, seurat on the
 * expression; scvi_denovo is planned). Runs `scfoundry integrate` once; task.ext.args
 * (conf/modules.config) adds --embedding, --theta, --layer, --log-normalized, --dims, --k-weight.
 */
process INTEGRATE {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_medium'

    input:
    tuple val(meta), path(h5ad)
    val method

    output:
    tuple val(meta), path("${meta.id}.${method}.h5ad"), emit: h5ad
    path "versions.yml",                                emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} integrate \\
        --method ${method} \\
        --data ${h5ad} \\
        --batch-key ${params.batch_key} \\
        --seed ${params.seed} \\
        --out ${meta.id}.${method}.h5ad \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    touch ${meta.id}.${method}.h5ad

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
