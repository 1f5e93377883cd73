/*
 * TRANSFER: Transfer labels from an embedded reference to an embedded query.
 * Runs `scfoundry transfer` once; task.ext.args (conf/modules.config) adds method options.
 * With `embedding` set, both files already hold obsm[embedding] (EMBED_REFERENCE and EMBED_QUERY
 * wrote it) and the vote uses it; with '' the task embeds both itself (pca: fitted on the
 * reference, the query projected with that fit).
 */
process TRANSFER {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_low'

    input:
    tuple val(meta), path(reference, stageAs: 'reference/*'), path(query, stageAs: 'query/*')
    val method
    val embedding

    output:
    tuple val(meta), path("${meta.id}.transfer.h5ad"), emit: h5ad
    tuple val(meta), path("${meta.id}.transfer"),      emit: report
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    def use = embedding ? "--embedding ${embedding}" : ''
    """
    ${params.scfoundry} ${weights} transfer \\
        --method ${method} \\
        --reference ${reference} \\
        --query ${query} \\
        --label-key ${params.label_key} \\
        --out ${meta.id}.transfer.h5ad \\
        --report-dir ${meta.id}.transfer \\
        --seed ${params.seed} \\
        --max-forks 1 \\
        ${use} \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    touch ${meta.id}.transfer.h5ad
    mkdir ${meta.id}.transfer

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
