use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = kvwire_cli::Cli::parse();
    let mut out = String::new();
    let result = kvwire_cli::run(cli, &mut out);
    print!("{out}");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(),
    }
}
