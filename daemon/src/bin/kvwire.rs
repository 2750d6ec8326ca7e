use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = kvwired::cli::Cli::parse();
    let mut out = String::new();
    let result = kvwired::cli::run(cli, &mut out);
    print!("{out}");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(),
    }
}
