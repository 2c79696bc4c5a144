//! `genpool`: see the `genpool_cli` library for the commands.

use std::process::ExitCode;

fn main() -> ExitCode {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match genpool_cli::run(std::env::args_os(), &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(genpool_cli::CliError::Usage(e)) => {
            // clap formats help, version and usage errors itself (help/version on stdout, exit 0).
            let code = e.exit_code();
            let _ = e.print();
            ExitCode::from(u8::try_from(code).unwrap_or(2))
        }
        Err(e) => {
            eprintln!("genpool: {e}");
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
        }
    }
}
