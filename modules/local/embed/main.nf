/*
 * EMBED: Embed the cells of one .h5ad with a method; writes obsm["X_<method>"] into a new .h5ad.
 * Runs `scfoundry embed` once; task.ext.args (conf/modules.config) adds method options.
 */
process EMBED {
    tag "${meta.id}"
    label 'process_gpu'
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
    ${params.scfoundry} ${weights} embed \\
        --method ${method} \\
        --data ${h5ad} \\
        --out ${meta.id}.${method}.h5ad \\
        --seed ${params.seed} \\
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
