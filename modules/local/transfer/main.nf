/*
 * TRANSFER: Transfer labels from an embedded reference to an embedded query.
 * Runs `scfoundry transfer` once; task.ext.args (conf/modules.config) adds method options.
 */
process TRANSFER {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_low'

    input:
    tuple val(meta), path(reference, stageAs: 'reference/*'), path(query, stageAs: 'query/*')
    val method

    output:
    tuple val(meta), path("${meta.id}.transfer.h5ad"), emit: h5ad
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} transfer \\
        --method ${method} \\
        --reference ${reference} \\
        --query ${query} \\
        --label-key ${params.label_key} \\
        --out ${meta.id}.transfer.h5ad \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    touch ${meta.id}.transfer.h5ad

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
