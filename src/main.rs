use std::process::ExitCode;

use clap::Parser;

use scfoundry::cli::{Cli, Commands, MethodsCommand, WeightsCommand};
use scfoundry::commands::{self, ExitStatus};
use scfoundry::error::Error;
use scfoundry::settings::Settings;

fn main() -> ExitCode {
    // Behave like other command-line tools when piped into `head`: exit quietly on SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    scfoundry::host_memory::keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            // --help and --version are successes; any usage error is the user's: exit 1
            return ExitCode::from(if e.use_stderr() { 1 } else { 0 });
        }
    };
    match run(cli) {
        Ok(status) => ExitCode::from(status.code().clamp(0, 255) as u8),
        Err(err) => {
            report(&err);
            let internal = err.downcast_ref::<Error>().is_some_and(|e| !e.is_user_error());
            ExitCode::from(if internal { 2 } else { 1 })
        }
    }
}

/// `error:`, then each cause, then the first hint found in the chain.
fn report(err: &anyhow::Error) {
    eprintln!("error: {err}");
    // a cause already spelled out by the line above (an I/O error after its path) is not repeated
    let mut last = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !last.contains(&text) {
            eprintln!("  caused by: {text}");
        }
        last = text;
    }
    if let Some(hint) = err.chain().find_map(|c| c.downcast_ref::<Error>().and_then(Error::hint).or_else(|| c.downcast_ref::<scfoundry::gpu::GpuError>().and_then(scfoundry::gpu::GpuError::hint))) {
        eprintln!("hint: {hint}");
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitStatus> {
    scfoundry::lifecycle::install();
    let g = &cli.global;
    if let Some(genome) = &g.genome {
        // read by anndata::convert here and in the task processes this run starts
        std::env::set_var(scfoundry::settings::EnvVars::GENOME, genome);
    }
    if let Commands::Task { spec } = &cli.command {
        let command_tasks: &[(&str, scfoundry::tasks::CommandTask)] = &[
            ("benchmark", commands::benchmark::task),
            ("geometry", |spec, _| commands::geometry::task(spec)),
            ("finetune", commands::finetune::task),
        ];
        return scfoundry::tasks::run(spec, command_tasks).map(|()| ExitStatus::Success);
    }
    if let Commands::HoldGpu { gpus, record, ms } = &cli.command {
        return scfoundry::tasks::hold_gpu(gpus, record, *ms).map(|()| ExitStatus::Success);
    }
    if let Commands::Init(a) = &cli.command {
        return commands::init::init(&a.dir, g.weights_dir.as_deref(), g.quiet);
    }
    let s = Settings::resolve(g.workspace.as_deref(), g.weights_dir.as_deref(), g.quiet)?;
    match &cli.command {
        Commands::Methods(a) => match &a.command {
            None | Some(MethodsCommand::List) => commands::methods::run(&s.registry, None),
            Some(MethodsCommand::Show { name }) => commands::methods::run(&s.registry, Some(name)),
        },
        Commands::Weights(a) => match &a.command {
            WeightsCommand::List { method, hash, markdown } => commands::weights::list(&s, method.as_deref(), *hash, *markdown),
            WeightsCommand::Verify { names } => commands::weights::verify(&s, names),
            WeightsCommand::Pull { names, force, timeout, require_pinned, repin } => commands::weights::pull(
                &s,
                names,
                &commands::weights::PullOptions {
                    force: *force,
                    timeout: std::time::Duration::from_secs(*timeout),
                    require_pinned: *require_pinned,
                    repin: *repin,
                },
            ),
            WeightsCommand::Path { names } => commands::weights::path(&s, names),
            WeightsCommand::Import { name, path, force, repin, link } => {
                commands::weights_import::run(&s, name, path, &commands::weights_import::ImportOptions { force: *force, repin: *repin, link: *link })
            }
        },
        Commands::Embed(a) => commands::embed::run(&s, a),
        Commands::Transfer(a) => commands::transfer::run(&s, a),
        Commands::Finetune(a) => commands::finetune::run(&s, a),
        Commands::Integrate(a) => commands::integrate::run(&s, a),
        Commands::Benchmark(a) => commands::benchmark::run(&s, a),
        Commands::Geometry(a) => commands::geometry::run(&s, a),
        Commands::Config(a) => commands::config::run(&s, a),
        Commands::Trace(a) => commands::trace::run(a),
        Commands::Doctor(a) => commands::doctor::run(&s, a),
        Commands::Init(_) | Commands::Task { .. } | Commands::HoldGpu { .. } => unreachable!(),
    }
}
