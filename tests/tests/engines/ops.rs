//! Operations on the real engines: the daemons speak the service manager's
//! readiness protocol.

use std::time::Duration;

use pdbridge_tests::{Daemon, Engines, Scratch};
use tokio::net::UnixDatagram;

/// `Type=notify`: READY=1 arrives only once the engine is ready, STOPPING=1 on SIGTERM.
#[tokio::test]
async fn sd_notify_ready_after_the_engine_and_stopping_on_sigterm() {
    let engines = Engines::locate();
    let scratch = Scratch::new("notify");
    let socket_path = scratch.0.join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    let config = engines.decoded_config(&scratch.0.join("store"), 16, "[front]\nlisten = \"127.0.0.1:0\"\n");
    let mut decoded =
        Daemon::start_with_env("decoded", &config, &[("NOTIFY_SOCKET", socket_path.to_str().unwrap())]).await;

    let mut buf = [0u8; 256];
    let n =
        tokio::time::timeout(Duration::from_secs(300), socket.recv(&mut buf)).await.expect("READY=1 in time").unwrap();
    assert_eq!(&buf[..n], b"READY=1\n", "{}", String::from_utf8_lossy(&buf[..n]));
    let ready = reqwest::get(decoded.admin_url("/readyz")).await.unwrap().status();
    assert_eq!(ready.as_u16(), 200, "READY=1 was sent before the engine was ready");

    decoded.terminate();
    let n = tokio::time::timeout(Duration::from_secs(30), socket.recv(&mut buf))
        .await
        .expect("STOPPING=1 in time")
        .unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1\n");
    assert_eq!(decoded.wait(Duration::from_secs(60)).await.code(), Some(0));
}
