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

pub mod hosts;
pub mod otlp;
pub mod prometheus;

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::mpsc,
};

/// The workspace root (tests run with the package dir as cwd).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace").to_path_buf()
}

/// Path of a daemon binary built beside the running executable: a test in
/// `target/<profile>/deps/` or a bench binary in `target/<profile>/`. The
/// README's test command builds the binaries first (`cargo build --bins`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("executable path");
    let dir = exe.parent().expect("executable dir");
    [dir.join(name), dir.parent().map(|d| d.join(name)).unwrap_or_default()]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} is not built beside {}; run `cargo build --workspace --bins` first", exe.display())
        })
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

/// A loopback port held until a daemon is about to bind it, for a daemon whose
/// address another daemon's config must name before it starts (prefilld dials
/// only the decoders in its config). While held, the kernel gives the port to
/// no one else; released just before the daemon binds it.
pub struct Reserved(std::net::TcpListener);

impl Reserved {
    pub fn new() -> Reserved {
        Reserved(std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
    }

    pub fn addr(&self) -> SocketAddr {
        self.0.local_addr().expect("bound")
    }

    /// Frees the port; `config`'s kernel-chosen gRPC listener becomes it.
    pub fn release_into(self, config: &str) -> String {
        let addr = self.addr();
        drop(self);
        config.replacen("grpc_listen = \"127.0.0.1:0\"", &format!("grpc_listen = \"{addr}\""), 1)
    }
}

impl Default for Reserved {
    fn default() -> Self {
        Self::new()
    }
}

/// A deployment's certificates, made with `pdbridge certs` as an operator
/// would: one CA, one certificate per identity.
pub struct Pki {
    pub dir: PathBuf,
    _scratch: Scratch,
}

impl Pki {
    pub async fn new(names: &[&str]) -> Pki {
        let scratch = Scratch::new("pki");
        let dir = scratch.0.join("certs");
        let mut args = vec!["certs", "--out", dir.to_str().unwrap()];
        args.extend(names);
        let (status, stderr) = run_to_exit("pdbridge", &args, &[]).await;
        assert!(status.success(), "pdbridge certs failed: {stderr}");
        Pki { dir, _scratch: scratch }
    }

    /// A `[tls]` section: `name`'s certificate, trusting the CA, letting `peers` call.
    pub fn section(&self, name: &str, peers: &[&str]) -> String {
        format!(
            "[tls]\ncert = {cert:?}\nkey = {key:?}\nca = {ca:?}\npeers = {peers:?}\n",
            cert = self.dir.join(format!("{name}.pem")),
            key = self.dir.join(format!("{name}.key")),
            ca = self.dir.join("ca.pem"),
        )
    }

    /// A TLS client (for prefilld's stage listener) trusting the CA and presenting `name`'s
    /// certificate, or none.
    pub fn rustls_client(&self, name: Option<&str>) -> tokio_rustls::TlsConnector {
        use tokio_rustls::rustls::{
            ClientConfig, RootCertStore,
            pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
        };
        let pem = |file: String| self.dir.join(file);
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(pem("ca.pem".into())).unwrap()).unwrap();
        let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match name {
            Some(name) => {
                let chain = vec![CertificateDer::from_pem_file(pem(format!("{name}.pem"))).unwrap()];
                builder
                    .with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(pem(format!("{name}.key"))).unwrap())
                    .unwrap()
            }
            None => builder.with_no_client_auth(),
        };
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
    }

    /// `name`'s certificate, for a test's own gRPC client.
    pub fn client(&self, name: &str) -> pdbridge_common::tls::Tls {
        let config = pdbridge_common::tls::TlsConfig {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            ca: self.dir.join("ca.pem"),
            peers: Vec::new(),
        };
        pdbridge_common::tls::Tls::load(&config).expect("certificates made by pdbridge certs")
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

/// decoded without an engine, on a fixed spec written into `dir` (2 layers of
/// fp32 K/V, 2 KV heads of 8 dims, blocks of `block_tokens`): the store and
/// `CacheStore` behave as with an engine, at none of its cost. `extra` is
/// appended (e.g. more `[store]` keys).
pub fn fixed_spec_config(dir: &Path, store_dir: &Path, block_tokens: u32, extra: &str) -> String {
    use sha2::Digest;
    std::fs::create_dir_all(dir).unwrap();
    let bundle = dir.join("bundle.bin");
    let bundle_bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&bundle, &bundle_bytes).unwrap();
    let sha: String = sha2::Sha256::digest(&bundle_bytes).iter().map(|b| format!("{b:02x}")).collect();
    let layer = |index: u32| {
        let tensor = |name: &str| serde_json::json!({"name": name, "dtype": "DTYPE_F32", "shape": [1, 2, 1, 8], "token_axis": 2, "extent": "EXTENT_PER_TOKEN"});
        serde_json::json!({
            "index": index, "cache_class": "KVCache", "kind": "CACHE_KIND_ROWS", "tensors": [tensor("keys"), tensor("values")],
            "rewindable": true, "takes_tail": true, "from_inputs": true,
            "rope": {"kind": "default", "module": "RoPE", "base": 10000.0, "traditional": false, "dims": 8},
        })
    };
    let info = serde_json::json!({
        "model_id": "fixed-spec", "bundle_path": bundle, "bundle_sha256": sha, "tokenizer_sha256": "00",
        "spec": {
            "architecture": "LlamaForCausalLM", "num_layers": 2, "hidden_size": 32, "vocab_size": 49152, "max_context": 8192,
            "block_tokens": block_tokens, "layers": [layer(0), layer(1)],
            "decoder_code": {"model_type": "llama", "mlx": "0.32.4", "mlx_lm": "0.32.2"}, "input_dtype": "DTYPE_F32",
        },
    });
    let spec_file = dir.join("spec.json");
    std::fs::write(&spec_file, info.to_string()).unwrap();
    format!(
        "spec_file = {spec_file:?}\n{server}[store]\ndir = {store_dir:?}\nblock_tokens = {block_tokens}\n{extra}",
        server = loopback_config("decoded", "5s"),
    )
}

/// A running daemon process.
pub struct Daemon {
    pub name: String,
    child: Child,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// decoded's OpenAI front door.
    pub front: Option<SocketAddr>,
    /// Whether its gRPC listener speaks mutual TLS (its config has `[tls]`).
    pub tls: bool,
    /// Every log line so far, for failure messages.
    log: Arc<Mutex<Vec<String>>>,
    /// Reads the daemon's stderr into `log` until the pipe closes.
    log_reader: Option<tokio::task::JoinHandle<()>>,
    _scratch: Scratch,
}

impl Daemon {
    /// Starts `name` with `config` (TOML) and waits until it logs its
    /// listening addresses.
    pub async fn start(name: &str, config: &str) -> Daemon {
        Self::start_with_env(name, config, &[]).await
    }

    /// [`Daemon::start`] with extra environment variables.
    pub async fn start_with_env(name: &str, config: &str, env: &[(&str, &str)]) -> Daemon {
        let scratch = Scratch::new(name);
        let config_path = scratch.write("config.toml", config);
        let config_path = config_path.canonicalize().expect("scratch path");
        let mut child = Command::new(binary(name))
            .arg("--config")
            .arg(&config_path)
            .arg("--log-format")
            .arg("json")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
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
        let log_reader = tokio::spawn(async move {
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
        Daemon {
            name: name.to_owned(),
            child,
            grpc,
            admin,
            front,
            tls: config.contains("[tls]"),
            log,
            log_reader: Some(log_reader),
            _scratch: scratch,
        }
    }

    pub fn grpc_uri(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.grpc)
    }

    /// A gRPC channel to the daemon (plain: no `[tls]`).
    pub async fn channel(&self) -> tonic::transport::Channel {
        self.channel_as(None, "").await.unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
    }

    /// A gRPC channel presenting `tls`'s certificate, expecting the daemon to
    /// hold `identity`; the handshake's failure as text.
    pub async fn channel_as(
        &self,
        tls: Option<&pdbridge_common::tls::Tls>,
        identity: &str,
    ) -> Result<tonic::transport::Channel, String> {
        let endpoint = pdbridge_common::tls::endpoint(&self.grpc_uri(), tls, Some(identity))?;
        endpoint.connect().await.map_err(|e| pdbridge_common::error_chain(&e))
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("daemon is running") as i32
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal(libc::SIGTERM);
    }

    /// Sends SIGKILL: the daemon dies without a drain, as in a crash.
    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill({signal}) failed");
    }

    /// Pids of the daemon's child processes (its engine), from Linux's procfs
    /// (each thread lists the children it spawned).
    pub fn children(&self) -> Vec<i32> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).expect("procfs");
        let mut pids: Vec<i32> = tasks
            .flatten()
            .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
            .flat_map(|list| list.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<_>>())
            .collect();
        pids.sort();
        pids
    }

    /// Waits for the process to exit, failing the test after `limit`; the
    /// log then holds every line the daemon wrote.
    pub async fn wait(&mut self, limit: Duration) -> ExitStatus {
        let status = match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait for daemon"),
            Err(_) => panic!("{} still running after {limit:?}; log:\n{}", self.name, self.log_text()),
        };
        if let Some(reader) = self.log_reader.take() {
            // The pipe closes with the process (its engines write elsewhere).
            let _ = tokio::time::timeout(Duration::from_secs(10), reader).await;
        }
        status
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Freezes the daemon's engine as a wedged host would leave it: SIGSTOP to the process group
    /// its one child leads (every process of the engine: vLLM's workers too).
    pub fn freeze_engine(&self) -> Frozen {
        let engine = self.children();
        assert_eq!(engine.len(), 1, "{} runs one engine child: {engine:?}", self.name);
        // SAFETY: getpgid(2) and kill(2) on our daemon's own engine child and its group.
        let group = unsafe { libc::getpgid(engine[0]) };
        assert_eq!(group, engine[0], "the engine leads its own process group");
        assert_eq!(unsafe { libc::kill(-group, libc::SIGSTOP) }, 0, "SIGSTOP to the engine's group");
        Frozen(group)
    }
}

/// An engine's process group stopped by [`Daemon::freeze_engine`]; continued (SIGCONT) when
/// dropped, so a failing test never leaves it stopped.
pub struct Frozen(i32);

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the group this value stopped.
        unsafe { libc::kill(-self.0, libc::SIGCONT) };
    }
}

/// How much of a daemon's log a failed test shows.
const DYING_LOG_LINES: usize = 60;

impl Drop for Daemon {
    /// A test that fails mid-way still stops its daemon gracefully, so the
    /// daemon stops its engines too, and shows the end of the daemon's log.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log.lock().unwrap();
            let tail = log.iter().skip(log.len().saturating_sub(DYING_LOG_LINES));
            eprintln!("--- the last {DYING_LOG_LINES} lines of its log, with gRPC on {} ---", self.grpc);
            tail.for_each(|line| eprintln!("{line}"));
        }
        let Ok(None) = self.child.try_wait() else { return };
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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

/// Paths of the real engines and models, as prepared by `scripts/test.sh`.
pub struct Engines {
    pub python: PathBuf,
    pub decoder_model: PathBuf,
    pub prefill_model: PathBuf,
    pub adapter_dir: PathBuf,
    pub plugin_dir: PathBuf,
    /// What vLLM computes in (the prefill folder's `torch_dtype`).
    pub prefill_dtype: String,
}

impl Engines {
    pub fn locate() -> Engines {
        let root = workspace_root();
        let engines = Engines {
            python: root.join(".venv/bin/python"),
            decoder_model: root.join("models/smollm2-mlx"),
            prefill_model: root.join("models/smollm2-hf"),
            adapter_dir: root.join("decoded/engine"),
            plugin_dir: root.join("prefilld/engine"),
            prefill_dtype: "float32".into(),
        };
        for path in [&engines.python, &engines.decoder_model, &engines.prefill_model] {
            assert!(
                path.exists(),
                "{} is missing: run scripts/test.sh (it installs the engines and prepares the model)",
                path.display()
            );
        }
        engines
    }

    /// The same engines on a generated checkpoint (`scripts/make-tiny-model.py --family <family>`):
    /// a folder per engine, or one folder both load (a checkpoint in its publisher's format).
    pub fn family(family: &str) -> Engines {
        Engines::checkpoint(&format!("tiny-{family}"))
    }

    /// The same engines on the checkpoint `models/<name>-{mlx,hf}` (or `models/<name>`, one folder
    /// both load): a generated family's, or a real one (`scripts/prepare-gguf-model.py`).
    pub fn checkpoint(name: &str) -> Engines {
        let root = workspace_root();
        let published = root.join(format!("models/{name}"));
        let folder = |engine: &str| match published.exists() {
            true => published.clone(),
            false => root.join(format!("models/{name}-{engine}")),
        };
        let engines = Engines { decoder_model: folder("mlx"), prefill_model: folder("hf"), ..Engines::locate() };
        for path in [&engines.decoder_model, &engines.prefill_model] {
            assert!(path.exists(), "{} is missing: run scripts/test.sh (it prepares the checkpoints)", path.display());
        }
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(engines.prefill_model.join("config.json")).unwrap()).unwrap();
        let prefill_dtype = config["torch_dtype"].as_str().unwrap_or("float32").to_owned();
        Engines { prefill_dtype, ..engines }
    }

    /// The test model with its decoder dense: the 4-bit weights dequantized to fp32 (the prefill
    /// folder, which mlx-lm loads as it is). Its native prefill runs ~10x faster than the 4-bit
    /// decoder's on this CPU (512 tokens: ~7 s vs ~70 s; MLX's CPU quantized matmul is a plain
    /// loop), for tests of the front door and the topology rather than of quantization.
    pub fn dense() -> Engines {
        let engines = Engines::locate();
        Engines { decoder_model: engines.prefill_model.clone(), ..engines }
    }

    /// The environment both daemons give their engines, as TOML `key = value` pairs: MLX's CPU
    /// backend (the decoder's, and the prefill side's reconstruction) multiplies on
    /// [`Engines::openblas`], one thread per process (the tests' processes already share two
    /// cores; a second BLAS thread only spins).
    fn engine_env(&self) -> [String; 2] {
        [format!("LD_PRELOAD = {:?}", self.openblas()), "OPENBLAS_NUM_THREADS = \"1\"".into()]
    }

    /// The OpenBLAS the engines' environment holds (opencv-python-headless's): MLX's CPU backend on
    /// Linux multiplies dense fp32 on a reference BLAS, ~70x slower, unless this is preloaded.
    fn openblas(&self) -> PathBuf {
        let lib = self.python.parent().and_then(Path::parent).expect(".venv/bin/python").join("lib");
        std::fs::read_dir(&lib)
            .unwrap_or_else(|e| panic!("{}: {e}", lib.display()))
            .flatten()
            .filter_map(|python| {
                std::fs::read_dir(python.path().join("site-packages/opencv_python_headless.libs")).ok()
            })
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .find(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("libopenblas")))
            .unwrap_or_else(|| {
                panic!("no libopenblas*.so under {}/*/site-packages/opencv_python_headless.libs", lib.display())
            })
    }

    /// decoded with its real engine; `extra` is appended (e.g. a `[front]` section).
    pub fn decoded_config(&self, store_dir: &Path, block_tokens: u32, extra: &str) -> String {
        format!(
            "{server}[store]\ndir = {store:?}\nblock_tokens = {block_tokens}\n\
             [engine]\npython = {python:?}\nadapter_dir = {adapter:?}\nmodel = {model:?}\nsocket = {socket:?}\n\
             env = {{ {env} }}\n{extra}",
            server = loopback_config("prefilld", "5s"),
            env = self.engine_env().join(", "),
            store = store_dir,
            python = self.python,
            adapter = self.adapter_dir,
            model = self.decoder_model,
            socket = store_dir.with_extension("sock"),
        )
    }

    /// prefilld with real vLLM; `extra` is appended: its `[[decoders]]`
    /// ([`decoders`]) and, for mutual TLS, `[tls]`.
    pub fn prefilld_config(&self, var_dir: &Path, extra: &str) -> String {
        self.prefilld_config_parallel(var_dir, "", extra)
    }

    /// [`Engines::prefilld_config`] with vLLM spread over processes by `engine_keys` (more
    /// `[engine]` keys, e.g. `pipeline_parallel_size = 2`): one core bound to each process, as
    /// this rig has no second NUMA node for vLLM's automatic binding.
    pub fn prefilld_config_parallel(&self, var_dir: &Path, engine_keys: &str, extra: &str) -> String {
        let bind = if engine_keys.is_empty() { "" } else { "VLLM_CPU_OMP_THREADS_BIND = \"0|1\"\n" };
        self.prefilld_config_with(var_dir, engine_keys, bind, extra)
    }

    /// [`Engines::prefilld_config_parallel`] with `env_keys` for vLLM's `[engine.env]` instead of
    /// its cores.
    /// (vLLM's KV space is 1 GiB: a test model's 4096-token prompt needs < 200 MB, and the tests
    /// running at once share the machine's memory.)
    pub fn prefilld_config_with(&self, var_dir: &Path, engine_keys: &str, env_keys: &str, extra: &str) -> String {
        let args = if engine_keys.is_empty() { String::new() } else { format!("{engine_keys}\n") };
        format!(
            "{server}[engine]\npython = {python:?}\nplugin_dir = {plugin:?}\nmodel = {model:?}\ndtype = {dtype:?}\n\
             max_model_len = 4096\nplugin_socket = {socket:?}\nbundle_dir = {bundles:?}\n{args}\
             [engine.env]\nVLLM_CPU_KVCACHE_SPACE = \"1\"\nVLLM_CPU_NUM_OF_RESERVED_CPU = \"1\"\n{env}\n{env_keys}{extra}",
            server = loopback_config("prefilld", "5s"),
            env = self.engine_env().join("\n"),
            python = self.python,
            plugin = self.plugin_dir,
            model = self.prefill_model,
            dtype = self.prefill_dtype,
            socket = var_dir.join("plugin.sock"),
            bundles = var_dir.join("bundles"),
        )
    }
}

/// `[[decoders]]` entries for prefilld: it pushes only to these (the first is
/// met at start and gates its readiness).
pub fn decoders(addrs: &[String]) -> String {
    addrs.iter().map(|addr| format!("[[decoders]]\naddr = {addr:?}\n")).collect()
}

/// Real text for prompts: the Apache License 2.0 at the repository root.
pub fn license_text() -> String {
    std::fs::read_to_string(workspace_root().join("LICENSE")).expect("LICENSE at the repository root")
}

impl Daemon {
    /// Waits until `/readyz` answers 200 (the engine is up), failing after `limit`.
    pub async fn wait_ready(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        let url = self.admin_url("/readyz");
        loop {
            if reqwest::get(&url).await.is_ok_and(|r| r.status() == reqwest::StatusCode::OK) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} not ready after {limit:?}; log:\n{}",
                self.name,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until gRPC health of `service` (asked over `channel`) and `/readyz` both say
    /// `serving` (SERVING and 200) or both say not (NOT_SERVING and 503), failing after `limit`.
    pub async fn wait_serving(
        &self,
        channel: &tonic::transport::Channel,
        service: &str,
        serving: bool,
        limit: Duration,
    ) {
        use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
        let (want, want_readyz) =
            if serving { (ServingStatus::Serving, 200) } else { (ServingStatus::NotServing, 503) };
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let mut client = HealthClient::new(channel.clone());
            let grpc =
                client.check(HealthCheckRequest { service: service.into() }).await.map(|r| r.into_inner().status());
            let readyz = reqwest::get(self.admin_url("/readyz")).await.map(|r| r.status().as_u16());
            if grpc.as_ref().is_ok_and(|s| *s == want) && readyz.as_ref().is_ok_and(|c| *c == want_readyz) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}: health {grpc:?} and /readyz {readyz:?}, not {want:?} and {want_readyz}, after {limit:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// decoded's token ids for a chat, as its front door will see it (`/pd/v1/tokenize`).
    pub async fn tokenize_chat(&self, messages: &serde_json::Value) -> Vec<u32> {
        let url = format!("http://{}/pd/v1/tokenize", self.front.expect("decoded's front door"));
        let body = serde_json::json!({"messages": messages});
        let reply: serde_json::Value =
            reqwest::Client::new().post(url).json(&body).send().await.unwrap().json().await.unwrap();
        serde_json::from_value(reply["tokens"].clone()).expect("token ids")
    }

    /// The value of the series `name` (with its labels, as scraped) in a
    /// scrape of `/metrics`, if the daemon answers and publishes it.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = reqwest::get(self.admin_url("/metrics")).await.ok()?.text().await.ok()?;
        text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
    }

    /// Waits until the daemon has logged a line for which `wanted` holds, failing after `limit`.
    pub async fn wait_log(&self, what: &str, wanted: impl Fn(&str) -> bool, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.log.lock().unwrap().iter().any(|line| wanted(line)) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} logged no {what} in {limit:?}:\n{}",
                self.name,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the series `name` reads at least `value`, failing after `limit`.
    pub async fn wait_metric(&self, name: &str, value: f64, limit: Duration) {
        self.wait_metric_where(name, &format!("at least {value}"), |v| v >= value, limit).await;
    }

    /// Waits until the series `name` satisfies `wanted` (described by `what`),
    /// failing after `limit`.
    pub async fn wait_metric_where(&self, name: &str, what: &str, wanted: impl Fn(f64) -> bool, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let now = self.metric(name).await;
            if now.is_some_and(&wanted) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} {name} is {now:?}, not {what}, after {limit:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Speaking `CacheStore` to a decoded as prefilld would: shards of blocks of
/// arbitrary bytes with the spec's exact shapes (the store does not
/// interpret cache values), Push streams and lookups.
pub mod cache_store {
    use bytes::Bytes;
    use pdbridge_common::{
        proto::{
            CacheSpec, LookupRequest, PushFrame, PushOpen, PushReceipt, PushSeal, Shard,
            cache_store_client::CacheStoreClient, push_frame::Frame,
        },
        shard::{self, TensorId},
        spec,
    };
    use tonic::transport::Channel;

    /// Every shard of block `index`: each tensor split in two, bytes derived from `seed`.
    pub fn block_shards(spec: &CacheSpec, index: u32, seed: u8) -> Vec<Shard> {
        rows_shards(spec, index, spec.block_tokens, seed)
    }

    /// [`block_shards`] for `rows` tokens (a prompt's tail).
    pub fn rows_shards(spec: &CacheSpec, index: u32, rows: u32, seed: u8) -> Vec<Shard> {
        let mut shards = Vec::new();
        for layer in &spec.layers {
            for tensor in &layer.tensors {
                let expected = spec::rows_tensor(spec, layer.index, &tensor.name, rows).unwrap();
                let len = expected.byte_len() as usize;
                let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
                let id = TensorId {
                    block_index: index,
                    layer: layer.index,
                    tensor: tensor.name.clone(),
                    dtype: expected.dtype,
                    shape: expected.shape.clone(),
                };
                shards.extend(shard::split(&id, Bytes::from(data), len.div_ceil(2)));
            }
        }
        shards
    }

    pub fn frames(open: PushOpen, shards: Vec<Shard>, seal: Option<u32>) -> Vec<PushFrame> {
        let mut out = vec![PushFrame { frame: Some(Frame::Open(open)) }];
        out.extend(shards.into_iter().map(|s| PushFrame { frame: Some(Frame::Shard(s)) }));
        out.extend(seal.map(|n| PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted: n })) }));
        out
    }

    pub async fn push(
        client: &mut CacheStoreClient<Channel>,
        frames: Vec<PushFrame>,
    ) -> Result<PushReceipt, tonic::Status> {
        client.push(tokio_stream::iter(frames)).await.map(|r| r.into_inner())
    }

    pub async fn cached_blocks(client: &mut CacheStoreClient<Channel>, tokens: &[u32]) -> u32 {
        client
            .lookup(LookupRequest { token_ids: tokens.to_vec(), spec_fingerprint: String::new() })
            .await
            .unwrap()
            .into_inner()
            .cached_blocks
    }
}
