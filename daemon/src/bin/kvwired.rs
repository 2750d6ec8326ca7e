use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// kvwired: the per-host kvwire daemon.
#[derive(Debug, Parser)]
#[command(name = "kvwired", version)]
struct Args {
    /// TOML settings (every key: config/kvwired.example.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `node`.
    #[arg(long)]
    node: Option<String>,
    /// Overrides `control_socket`.
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// Overrides `peer_listen`.
    #[arg(long)]
    peer_listen: Option<String>,
    /// Overrides `metrics_listen`.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Overrides `secret_file`.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Check the settings and exit.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, not into a journal or a file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvwired: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    // Layers: file, then environment, then flags.
    let mut cfg = match &args.config {
        Some(p) => kvwired::config::Config::load(p)?,
        None => kvwired::config::Config::default(),
    };
    cfg.apply_env(std::env::vars())?;
    if let Some(v) = args.node {
        cfg.node = v;
    }
    if let Some(v) = args.control_socket {
        cfg.control_socket = v;
    }
    if let Some(v) = args.peer_listen {
        cfg.peer_listen = v;
    }
    if let Some(v) = args.metrics_listen {
        cfg.metrics_listen = v;
    }
    if let Some(v) = args.secret_file {
        cfg.secret_file = Some(v);
    }
    cfg.validate()?;
    cfg.secret()?;
    if args.check {
        println!("kvwired: settings ok");
        return Ok(());
    }
    // Before any thread starts: every thread inherits it.
    let cpus = cfg.cpu_list()?;
    if !cpus.is_empty() {
        kvwire_transport::topology::run_on_cpus(&cpus).map_err(|e| anyhow::anyhow!("config key `cpus`: {e}"))?;
    }
    let d = kvwired::server::Daemon::start(cfg)?;
    // Report where we listen, so scripts can wait for readiness.
    println!("kvwired ready node={} peer={} data={}", d.node(), d.peer_addr(), d.data_addr());
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let mut signals = nix::sys::signal::SigSet::empty();
    signals.add(nix::sys::signal::Signal::SIGTERM);
    signals.add(nix::sys::signal::Signal::SIGINT);
    signals.thread_block()?;
    let sig = signals.wait()?;
    tracing::info!(?sig, "shutting down");
    d.shutdown();
    Ok(())
}
