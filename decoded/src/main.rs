#[tokio::main]
async fn main() -> std::process::ExitCode {
    pdbridge_common::daemon::main::<decoded::Decoded>().await
}
