//! The `megatrain` command line (see `cli`).
#![allow(clippy::print_stdout, clippy::print_stderr, clippy::exit)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
