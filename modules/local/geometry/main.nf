/*
 * GEOMETRY: Describe the geometry of one embedding (params.embedding, an obsm key) of one .h5ad;
 * the results folder holds geometry.tsv, geometry.json and the figure.
 * Runs `scfoundry geometry` once; task.ext.args (conf/modules.config) adds --max-cells.
 */
process GEOMETRY {
    tag "${meta.id}"
    label 'process_cpu'
    label 'process_low'

    input:
    tuple val(meta), path(h5ad)

    output:
    tuple val(meta), path("${meta.id}.geometry"), emit: results
    path "versions.yml",                               emit: versions

    when:
    task.ext.when == null || task.ext.when

    script:
    def args = task.ext.args ?: ''
    def weights = params.weights_dir ? "--weights-dir ${params.weights_dir}" : ''
    """
    ${params.scfoundry} ${weights} geometry \\
        --data ${h5ad} \\
        --embedding ${params.embedding} \\
        --seed ${params.seed} \\
        --out ${meta.id}.geometry \\
        ${args}

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """

    stub:
    """
    mkdir -p ${meta.id}.geometry
    touch ${meta.id}.geometry/geometry.tsv ${meta.id}.geometry/geometry.json

    cat <<-END_VERSIONS > versions.yml
    "${task.process}":
        scfoundry: \$(${params.scfoundry} --version | sed 's/^scfoundry //')
    END_VERSIONS
    """
}
