//! `conrub`: the command-line tool. Everything but this entry point is in `src/lib.rs`.

fn main() -> std::process::ExitCode {
    conrub::main()
}
