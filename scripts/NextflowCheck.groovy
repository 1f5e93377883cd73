/*
 * Parse Nextflow files with Groovy (Debian's groovy 2.4 on OpenJDK 17), in one JVM:
 *   groovy scripts/NextflowCheck.groovy [--config FILE]... [--nf FILE]...
 * Configs: ConfigSlurper, once plain and once per profile (registerConditionalBlock), with
 * Nextflow's `8.GB` / `2.h` units defined and `includeConfig` followed (each included file is
 * checked too). .nf files: compiled to the CONVERSION phase (syntax only).
 * Prints one line per file; exits 1 if any file fails. Used by scripts/validate-nextflow.sh.
 */
import org.codehaus.groovy.control.CompilationUnit
import org.codehaus.groovy.control.Phases

ExpandoMetaClass.enableGlobally()
[B: 1L, KB: 1024L, MB: 1024L ** 2, GB: 1024L ** 3, TB: 1024L ** 4].each { name, mult ->
    Number.metaClass."get${name}" = { -> (long) (delegate * mult) }
}
[ms: 1L, s: 1000L, m: 60000L, h: 3600000L, d: 86400000L, sec: 1000L, min: 60000L].each { name, mult ->
    Number.metaClass."get${name.capitalize()}" = { -> (long) (delegate * mult) }
}

def configs = []
def nfs = []
def mode = null
for (a in args) {
    if (a == '--config') { mode = configs }
    else if (a == '--nf') { mode = nfs }
    else if (mode == null) { System.err.println "usage: NextflowCheck.groovy [--config FILE]... [--nf FILE]..."; System.exit(2) }
    else { mode << new File(a) }
}

int failures = 0
def fail = { File f, String what, Throwable e ->
    failures++
    def msg = (e.message ?: e.toString()).readLines().take(6).join('\n    ')
    println "FAIL ${f.path}${what}: ${e.class.simpleName}: ${msg}"
}

def binding = [projectDir: '/project', launchDir: '/launch', baseDir: '/project', moduleDir: '/project/modules', workDir: '/work']
def seen = [] as Set
def queue = new ArrayDeque(configs)
while (!queue.isEmpty()) {
    File f = queue.poll()
    def key = f.canonicalPath
    if (!seen.add(key)) continue
    if (!f.isFile()) { failures++; println "FAIL ${f.path}: no such file"; continue }
    // includeConfig 'x' -> a comment; x (relative to this file's folder) is checked on its own
    def text = f.text.replaceAll(/(?m)^(\s*)includeConfig\s+['"]([^'"]+)['"]/) { all, indent, path ->
        def inc = new File(path)
        queue << (inc.absolute ? inc : new File(f.absoluteFile.parentFile, path))
        return "${indent}// includeConfig '${path}'"
    }
    def parse = { String profile ->
        def s = new ConfigSlurper()
        s.setBinding(binding)
        if (profile != null) s.registerConditionalBlock('profiles', profile)
        return s.parse(text)
    }
    try {
        def cfg = parse(null)
        def profiles = (cfg.profiles instanceof ConfigObject) ? (cfg.profiles.keySet() as List) : []
        def bad = false
        for (p in profiles) {
            try { parse(p) } catch (Throwable e) { fail(f, " (profile ${p})", e); bad = true }
        }
        if (!bad) println "ok   ${f.path} (config${profiles ? ', profiles: ' + profiles.join(' ') : ''})"
    } catch (Throwable e) {
        fail(f, '', e)
    }
}

for (f in nfs) {
    try {
        def cu = new CompilationUnit()
        cu.addSource(f)
        cu.compile(Phases.CONVERSION)
        println "ok   ${f.path} (groovy syntax)"
    } catch (Throwable e) {
        fail(f, '', e)
    }
}
System.exit(failures == 0 ? 0 : 1)
