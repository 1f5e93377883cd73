//! Nextflow configuration text, generated in one place: the workspace's `nextflow.config`
//! (`scfoundry config`) and each run's config (`--executor nextflow`).
//!
//! GPU cards, per engine, for `--gpu LIST` (`0`, `0-3`, `all`; `scfoundry config --gpu`): GPU
//! tasks run at most maxForks at once (default: the list's entries), and each task locks one
//! free card of the list itself (`gpu::cards`: by the card's UUID, in the node-local lock
//! folder), so the processes need not know which card is free. What each engine is given:
//! - no container: `SCFOUNDRY_GPUS` (the list) and `SCFOUNDRY_GPU_LOCKS` (the lock folder),
//!   exported by `beforeScript` for tasks that are not CPU-only (`task.ext.cpu_only`);
//! - Docker: `--gpus '"device=0,1,2,3"'` (the container sees the listed cards, numbered 0..n
//!   in host order, so the list it gets is renumbered) and the lock folder with `-v`; the
//!   variables reach the container through `docker.envWhitelist`;
//! - Apptainer / Singularity: `--nv` exposes every card, so CUDA_VISIBLE_DEVICES names the
//!   listed ones and is passed in with the two variables (`APPTAINERENV_` / `SINGULARITYENV_`
//!   and `envWhitelist`); the lock folder is bound with `-B`;
//! - Slurm: the scheduler assigns GPUs (`--gpus=1`) and sets CUDA_VISIBLE_DEVICES itself; a
//!   device list given by hand would fight it, so none is written.
//!
//! The text uses only syntax that Groovy 2.4's ConfigSlurper parses (see
//! scripts/validate-nextflow.sh).

use std::fmt::Write;
use std::path::{Path, PathBuf};

use crate::cli::ConfigProfile;
use crate::env::EnvVars;
use crate::gpu::cards::GpuList;

/// What goes into a generated config.
#[derive(Debug, Clone)]
pub struct NfConfig {
    /// The cards GPU tasks share (each task locks one).
    pub gpus: Option<GpuList>,
    /// The node-local folder of the card locks (bound into containers).
    pub gpu_locks: PathBuf,
    /// maxForks of GPU processes.
    pub max_forks: u64,
    /// Profiles to write pinning for (in this order).
    pub profiles: Vec<ConfigProfile>,
    pub weights_dir: PathBuf,
    pub work_dir: PathBuf,
    pub outdir: PathBuf,
    /// The scfoundry binary the processes run.
    pub scfoundry: String,
    /// Extra `params` (already Groovy literals), e.g. a run's task parameters.
    pub params: Vec<(String, String)>,
    /// A comment line saying what made the file.
    pub made_by: String,
}

/// A word for sh: as it is when it is plain, else single-quoted.
fn sh(word: &str) -> String {
    if !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "/_.,:=+@%-".contains(c)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// `export` of the variables a task needs to take its card, with `prefix`ed copies for a
/// container engine that passes `PREFIX<NAME>` in.
fn exports(vars: &[(&str, String)], prefix: Option<&str>) -> String {
    let mut words: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={}", sh(v))).collect();
    if let Some(p) = prefix {
        words.extend(vars.iter().map(|(k, v)| format!("{p}{k}={}", sh(v))));
    }
    format!("export {}", words.join(" "))
}

/// A `beforeScript` that runs `script` except in tasks of methods that run on CPUs.
fn gpu_tasks_only(script: &str) -> String {
    format!("{{ task.ext.cpu_only ? '' : {} }}", q(script))
}

/// The lines that give GPU tasks their cards for one profile: (directive, Groovy value) pairs.
pub fn pinning(profile: ConfigProfile, gpus: &GpuList, locks: &Path) -> Vec<(&'static str, String)> {
    let dir = locks.display().to_string();
    let mkdir = format!("mkdir -p {}", sh(&dir));
    let (list, lock) = (EnvVars::GPUS, EnvVars::GPU_LOCKS);
    match profile {
        ConfigProfile::Local => vec![("beforeScript", gpu_tasks_only(&format!("{mkdir}; {}", exports(&[(list, gpus.to_string()), (lock, dir.clone())], None))))],
        ConfigProfile::Docker => {
            let devices = match gpus.distinct() {
                Some(d) => format!("'\"device={}\"'", d.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
                None => "all".into(),
            };
            vec![
                ("beforeScript", gpu_tasks_only(&format!("{mkdir}; unset CUDA_VISIBLE_DEVICES; {}", exports(&[(list, gpus.renumbered().to_string()), (lock, dir.clone())], None)))),
                ("containerOptions", q(&format!("--gpus {devices} -v {}:{}", sh(&dir), sh(&dir)))),
            ]
        }
        ConfigProfile::Apptainer | ConfigProfile::Singularity => {
            let prefix = if profile == ConfigProfile::Apptainer { "APPTAINERENV_" } else { "SINGULARITYENV_" };
            let mut vars = vec![];
            if let Some(d) = gpus.distinct() {
                vars.push(("CUDA_VISIBLE_DEVICES", d.iter().map(u32::to_string).collect::<Vec<_>>().join(",")));
            }
            vars.push((list, gpus.to_string()));
            vars.push((lock, dir.clone()));
            vec![("beforeScript", gpu_tasks_only(&format!("{mkdir}; {}", exports(&vars, Some(prefix))))), ("containerOptions", q(&format!("--nv -B {}", sh(&dir))))]
        }
        ConfigProfile::Slurm => vec![("beforeScript", q("true")), ("clusterOptions", SLURM_GPU.into())],
    }
}

/// A Groovy single-quoted string literal.
pub fn q(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// A path as a Groovy string literal.
pub fn qp(p: &std::path::Path) -> String {
    q(&p.display().to_string())
}

/// One GPU from Slurm for GPU tasks, none for methods that run on CPUs (`ext.cpu_only`, set in
/// the pipeline's conf/modules.config from `params.cpu_methods`).
pub const SLURM_GPU: &str = "{ task.ext.cpu_only ? '' : '--gpus=1' }";

pub const TRACE_FIELDS: &str = "task_id,hash,native_id,name,status,exit,submit,duration,realtime,%cpu,peak_rss,peak_vmem,rchar,wchar";

fn profile_name(p: ConfigProfile) -> &'static str {
    match p {
        ConfigProfile::Local => "local",
        ConfigProfile::Docker => "docker",
        ConfigProfile::Apptainer => "apptainer",
        ConfigProfile::Singularity => "singularity",
        ConfigProfile::Slurm => "slurm",
    }
}

fn gpu_block(out: &mut String, indent: &str, lines: &[(&str, String)], max_forks: Option<u64>) {
    let _ = writeln!(out, "{indent}process {{");
    let _ = writeln!(out, "{indent}    withLabel: 'process_gpu' {{");
    if let Some(m) = max_forks {
        let _ = writeln!(out, "{indent}        maxForks = {m}");
    }
    for (k, v) in lines {
        let _ = writeln!(out, "{indent}        {k} = {v}");
    }
    let _ = writeln!(out, "{indent}    }}");
    let _ = writeln!(out, "{indent}}}");
}

impl NfConfig {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "// {}", self.made_by);
        s.push_str("// Generated by `scfoundry config`; run it again rather than editing by hand.\n");
        s.push_str("// Use it with the pipeline: nextflow run <scfoundry>/main.nf -c nextflow.config -profile <profile> ...\n\n");
        s.push_str("params {\n");
        let mut params: Vec<(String, String)> = vec![
            ("weights_dir".into(), qp(&self.weights_dir)),
            ("outdir".into(), qp(&self.outdir)),
            ("scfoundry".into(), q(&self.scfoundry)),
        ];
        params.push(("max_forks".into(), self.max_forks.to_string()));
        params.extend(self.params.iter().cloned());
        let w = params.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in &params {
            let _ = writeln!(s, "    {k:<w$} = {v}");
        }
        s.push_str("}\n\n");
        let _ = writeln!(s, "workDir = {}", qp(&self.work_dir));
        s.push_str("// delete a task's work folder once the run succeeds\ncleanup = true\n\n");
        s.push_str("trace {\n    enabled   = true\n    overwrite = true\n");
        let _ = writeln!(s, "    file      = {}", qp(&self.outdir.join("pipeline_info").join("trace.txt")));
        let _ = writeln!(s, "    fields    = {}", q(TRACE_FIELDS));
        s.push_str("}\n\nreport {\n    enabled   = true\n    overwrite = true\n");
        let _ = writeln!(s, "    file      = {}", qp(&self.outdir.join("pipeline_info").join("report.html")));
        s.push_str("}\n\n");
        s.push_str("// GPU tasks: at most maxForks at once");
        match &self.gpus {
            Some(g) => {
                let _ = writeln!(s, ", each locking one free card of GPUs {g} (lock files in {})", self.gpu_locks.display());
                gpu_block(&mut s, "", &pinning(ConfigProfile::Local, g, &self.gpu_locks), Some(self.max_forks));
            }
            None => {
                s.push('\n');
                gpu_block(&mut s, "", &[], Some(self.max_forks));
            }
        }
        let profiles: Vec<ConfigProfile> = self.profiles.iter().copied().filter(|p| *p != ConfigProfile::Local).collect();
        if !profiles.is_empty() {
            s.push_str("\nprofiles {\n");
            for (i, p) in profiles.iter().enumerate() {
                if i > 0 {
                    s.push('\n');
                }
                let name = profile_name(*p);
                let _ = writeln!(s, "    {name} {{");
                match p {
                    ConfigProfile::Docker => {
                        s.push_str("        docker.enabled = true\n");
                        if self.gpus.is_some() {
                            let _ = writeln!(s, "        docker.envWhitelist = '{},{}'", EnvVars::GPUS, EnvVars::GPU_LOCKS);
                        }
                    }
                    ConfigProfile::Apptainer | ConfigProfile::Singularity => {
                        let _ = writeln!(s, "        {name}.enabled = true\n        {name}.autoMounts = true");
                        let _ = writeln!(s, "        {name}.envWhitelist = 'CUDA_VISIBLE_DEVICES,{},{}'", EnvVars::GPUS, EnvVars::GPU_LOCKS);
                    }
                    ConfigProfile::Slurm => {
                        s.push_str("        process.executor = 'slurm'\n");
                        s.push_str("        // Slurm assigns GPUs and sets CUDA_VISIBLE_DEVICES; no device is pinned by hand\n");
                    }
                    ConfigProfile::Local => {}
                }
                if let Some(g) = &self.gpus {
                    gpu_block(&mut s, "        ", &pinning(*p, g, &self.gpu_locks), None);
                } else if *p == ConfigProfile::Slurm {
                    gpu_block(&mut s, "        ", &[("clusterOptions", SLURM_GPU.into())], None);
                } else if matches!(p, ConfigProfile::Docker) {
                    gpu_block(&mut s, "        ", &[("containerOptions", q("--gpus all"))], None);
                } else {
                    gpu_block(&mut s, "        ", &[("containerOptions", q("--nv"))], None);
                }
                s.push_str("    }\n");
            }
            s.push_str("}\n");
        }
        s
    }
}

/// All profiles, in the order they are written.
pub fn all_profiles() -> Vec<ConfigProfile> {
    vec![ConfigProfile::Local, ConfigProfile::Docker, ConfigProfile::Apptainer, ConfigProfile::Singularity, ConfigProfile::Slurm]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(p: ConfigProfile, gpus: &str, k: &str) -> Option<String> {
        pinning(p, &gpus.parse().unwrap(), Path::new("/tmp/locks")).into_iter().find(|(d, _)| *d == k).map(|(_, v)| v)
    }

    #[test]
    fn a_list_of_cards_per_profile() {
        use ConfigProfile::*;
        let only_gpu = |s: &str| format!("{{ task.ext.cpu_only ? '' : '{s}' }}");
        assert_eq!(get(Local, "0-3", "beforeScript").unwrap(), only_gpu("mkdir -p /tmp/locks; export SCFOUNDRY_GPUS=0,1,2,3 SCFOUNDRY_GPU_LOCKS=/tmp/locks"));
        assert_eq!(get(Local, "0-3", "containerOptions"), None);
        // docker: the container sees cards 2 and 3 as 0 and 1
        assert_eq!(get(Docker, "2,3,3", "containerOptions").unwrap(), r#"'--gpus \'"device=2,3"\' -v /tmp/locks:/tmp/locks'"#);
        assert_eq!(get(Docker, "2,3,3", "beforeScript").unwrap(), only_gpu("mkdir -p /tmp/locks; unset CUDA_VISIBLE_DEVICES; export SCFOUNDRY_GPUS=0,1,1 SCFOUNDRY_GPU_LOCKS=/tmp/locks"));
        assert_eq!(get(Docker, "all", "containerOptions").unwrap(), "'--gpus all -v /tmp/locks:/tmp/locks'");
        assert_eq!(get(Apptainer, "0-3", "containerOptions").unwrap(), "'--nv -B /tmp/locks'");
        assert_eq!(
            get(Apptainer, "0-3", "beforeScript").unwrap(),
            only_gpu("mkdir -p /tmp/locks; export CUDA_VISIBLE_DEVICES=0,1,2,3 SCFOUNDRY_GPUS=0,1,2,3 SCFOUNDRY_GPU_LOCKS=/tmp/locks APPTAINERENV_CUDA_VISIBLE_DEVICES=0,1,2,3 APPTAINERENV_SCFOUNDRY_GPUS=0,1,2,3 APPTAINERENV_SCFOUNDRY_GPU_LOCKS=/tmp/locks")
        );
        assert!(get(Singularity, "1", "beforeScript").unwrap().contains("SINGULARITYENV_CUDA_VISIBLE_DEVICES=1 "));
        // `all` leaves CUDA_VISIBLE_DEVICES alone: every card the container sees
        assert!(!get(Singularity, "all", "beforeScript").unwrap().contains("CUDA_VISIBLE_DEVICES"));
        assert_eq!(get(Slurm, "0-3", "clusterOptions").unwrap(), "{ task.ext.cpu_only ? '' : '--gpus=1' }");
        assert!(!get(Slurm, "0-3", "beforeScript").unwrap().contains("CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn config_for_four_cards() {
        let cfg = NfConfig {
            gpus: Some("0-3".parse().unwrap()),
            gpu_locks: "/tmp/scfoundry-gpu-locks-1000".into(),
            max_forks: 4,
            profiles: all_profiles(),
            weights_dir: "/w".into(),
            work_dir: "/work".into(),
            outdir: "/out".into(),
            scfoundry: "scfoundry".into(),
            params: vec![],
            made_by: "test".into(),
        };
        let text = cfg.render();
        let top = &text[..text.find("profiles {").unwrap()];
        assert!(top.contains("withLabel: 'process_gpu' {\n        maxForks = 4\n        beforeScript = { task.ext.cpu_only ? '' : 'mkdir -p /tmp/scfoundry-gpu-locks-1000; export SCFOUNDRY_GPUS=0,1,2,3 "), "{top}");
        assert!(text.contains("docker.envWhitelist = 'SCFOUNDRY_GPUS,SCFOUNDRY_GPU_LOCKS'"), "{text}");
        assert!(text.contains("apptainer.envWhitelist = 'CUDA_VISIBLE_DEVICES,SCFOUNDRY_GPUS,SCFOUNDRY_GPU_LOCKS'"), "{text}");
        assert!(text.contains(r#"containerOptions = '--gpus \'"device=0,1,2,3"\' -v /tmp/scfoundry-gpu-locks-1000:/tmp/scfoundry-gpu-locks-1000'"#), "{text}");
        assert!(text.contains("containerOptions = '--nv -B /tmp/scfoundry-gpu-locks-1000'"), "{text}");
    }

    #[test]
    fn odd_lock_folders_are_quoted_for_sh_and_groovy() {
        let v = get(ConfigProfile::Local, "0", "beforeScript").unwrap();
        assert!(v.contains("SCFOUNDRY_GPU_LOCKS=/tmp/locks"));
        let odd = pinning(ConfigProfile::Local, &"0".parse().unwrap(), Path::new("/my locks/it's")).remove(0).1;
        assert!(odd.contains(r"'mkdir -p \'/my locks/it\'\\\'\'s\'"), "{odd}");
        assert_eq!(sh("it's"), r"'it'\''s'");
    }

    #[test]
    fn quoting() {
        assert_eq!(q("it's"), r"'it\'s'");
        assert_eq!(q(r"a\b"), r"'a\\b'");
    }
}
