/*
 * FINETUNE: Fine-tune a model on the labelled cells of one .h5ad.
 * Runs `scfoundry finetune` once; task.ext.args (conf/modules.config) adds method options.
 */
process FINETUNE {
    tag "${meta.id}"
    label 'process_gpu'
    label 'process_high'

    input:
    tuple val(meta), path(h5ad)
    val method

    output:
    tuple val(meta), path("${meta.id}.${method}.finetune"), emit: model
    path "versions.yml",                                    emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} finetune \\
        --method ${method} \\
        --data ${h5ad} \\
        --label-key ${params.label_key} \\
        --seed ${params.seed} \\
        --out ${meta.id}.${method}.finetune \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    mkdir ${meta.id}.${method}.finetune

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
