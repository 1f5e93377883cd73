//! One file per command. Each takes resolved settings and returns an exit status.

pub mod config;
pub mod doctor;
pub mod benchmark;
pub mod embed;
pub mod finetune;
pub mod geometry;
pub mod init;
pub mod integrate;
pub mod methods;
pub mod trace;
pub mod transfer;
pub mod weights;
pub mod weights_import;

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Success,
    /// The user's input or the data is wrong (exit 1).
    Failure,
    /// A task process ended with this code.
    Code(i32),
}

impl ExitStatus {
    /// A process's exit code: 0 is success.
    pub fn from_code(code: i32) -> ExitStatus {
        if code == 0 {
            ExitStatus::Success
        } else {
            ExitStatus::Code(code)
        }
    }
    pub fn code(self) -> i32 {
        match self {
            ExitStatus::Success => 0,
            ExitStatus::Failure => 1,
            ExitStatus::Code(c) => c,
        }
    }
}

/// The cards `--gpu` gives the tasks: none under Slurm, which chooses cards itself (with a
/// warning that the list is ignored).
pub fn task_gpus(executor: crate::cli::ExecutorKind, gpu: &Option<crate::gpu::cards::GpuList>) -> Option<crate::gpu::cards::GpuList> {
    if executor == crate::cli::ExecutorKind::Slurm && gpu.is_some() {
        crate::progress::warn("--gpu names cards of this machine; with --executor slurm ask for GPUs with --gpus or --gres and Slurm chooses them (--gpu is ignored)");
        return None;
    }
    gpu.clone()
}
