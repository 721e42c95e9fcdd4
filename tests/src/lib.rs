//! Harness for the end-to-end tests: runs the real daemon binaries on loopback
//! with every port chosen by the kernel, and learns the bound addresses from
//! the daemons' own structured logs.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::mpsc,
};

/// The workspace root (tests run with the package dir as cwd).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace").to_path_buf()
}

/// Path of a daemon binary built beside the test executable. The README's test
/// command builds the binaries first (`cargo build --bins`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
    let path = dir.join(name);
    assert!(path.is_file(), "{} is not built; run `cargo build --workspace --bins` first", path.display());
    path
}

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pdb-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write scratch file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A daemon's config with every listener on a kernel-chosen loopback port
/// and no engine.
pub fn loopback_config(daemon: &str, drain_timeout: &str) -> String {
    let mut config = format!(
        "[server]\ngrpc_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndrain_timeout = \"{drain_timeout}\"\n"
    );
    if daemon == "decoded" {
        config.push_str("[front]\nlisten = \"127.0.0.1:0\"\n");
    }
    config
}

/// A running daemon process.
pub struct Daemon {
    pub name: String,
    child: Child,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// decoded's OpenAI front door.
    pub front: Option<SocketAddr>,
    /// Every log line so far, for failure messages.
    log: Arc<Mutex<Vec<String>>>,
    _scratch: Scratch,
}

impl Daemon {
    /// Starts `name` with `config` (TOML) and waits until it logs its
    /// listening addresses.
    pub async fn start(name: &str, config: &str) -> Daemon {
        let scratch = Scratch::new(name);
        let config_path = scratch.write("config.toml", config);
        let config_path = config_path.canonicalize().expect("scratch path");
        let mut child = Command::new(binary(name))
            .arg("--config")
            .arg(&config_path)
            .arg("--log-format")
            .arg("json")
            .env("RUST_LOG", "info")
            // Relative paths in a config (the store's default dir) land in scratch.
            .current_dir(&scratch.0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));

        let log = Arc::new(Mutex::new(Vec::new()));
        let (addrs_tx, mut addrs_rx) = mpsc::channel(1);
        let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        let sink = log.clone();
        let listening = format!("{name} listening");
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) {
                    let fields = &event["fields"];
                    if fields["message"] == listening.as_str() {
                        let addr = |k: &str| fields[k].as_str().and_then(|s| s.parse::<SocketAddr>().ok());
                        if let (Some(grpc), Some(admin)) = (addr("grpc"), addr("admin")) {
                            let _ = addrs_tx.send((grpc, admin, addr("front"))).await;
                        }
                    }
                }
                sink.lock().unwrap().push(line);
            }
        });

        let started = tokio::time::timeout(Duration::from_secs(60), addrs_rx.recv()).await;
        let Ok(Some((grpc, admin, front))) = started else {
            let status = child.try_wait().ok().flatten();
            panic!("{name} did not start (exit: {status:?}); log:\n{}", log.lock().unwrap().join("\n"));
        };
        Daemon { name: name.to_owned(), child, grpc, admin, front, log, _scratch: scratch }
    }

    pub fn grpc_uri(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// A gRPC channel to the daemon.
    pub async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(self.grpc_uri())
            .expect("valid uri")
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("daemon is running") as i32
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
        let rc = unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed");
    }

    /// Waits for the process to exit, failing the test after `limit`.
    pub async fn wait(&mut self, limit: Duration) -> ExitStatus {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait for daemon"),
            Err(_) => panic!("{} still running after {limit:?}; log:\n{}", self.name, self.log_text()),
        }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

/// Runs a daemon binary to completion with `args`, returning its exit status
/// and stderr (for config errors, which happen before logging starts).
pub async fn run_to_exit(name: &str, args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String) {
    let output = Command::new(binary(name))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    (output.status, String::from_utf8_lossy(&output.stderr).into_owned())
}
