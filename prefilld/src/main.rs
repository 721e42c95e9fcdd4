#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<_> = std::env::args_os().collect();
    if prefilld::node::requested(&args) {
        return prefilld::node::main(args).await;
    }
    pdbridge_common::daemon::main::<prefilld::Prefilld>().await
}
