/*
 * GEOMETRY: Describe the geometry of the embeddings of one .h5ad.
 * Runs `scfoundry geometry` once; task.ext.args (conf/modules.config) adds method options.
 */
process GEOMETRY {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_low'

    input:
    tuple val(meta), path(h5ad)

    output:
    tuple val(meta), path("${meta.id}.geometry.json"), emit: report
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} geometry \\
        --data ${h5ad} \\
        --out ${meta.id}.geometry.json \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    touch ${meta.id}.geometry.json

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
