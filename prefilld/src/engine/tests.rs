use serde_json::json;

use super::*;

/// The vLLM arguments prefilld starts an `architecture` with under the engine config `toml`.
fn vllm_args(toml: &str, architecture: &str) -> Result<Vec<String>, String> {
    vllm_args_as(toml, architecture, Role::Head)
}

/// [`vllm_args`] for the process `role` starts.
fn vllm_args_as(toml: &str, architecture: &str, role: Role) -> Result<Vec<String>, String> {
    // A file per call: the tests run side by side, several with the same architecture.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("pdb-engine-{}-{n}.toml", std::process::id()));
    std::fs::write(&file, toml).unwrap();
    let sources = pdbridge_common::config::Sources { file: Some(file.clone()), ..Default::default() };
    let config: Result<EngineConfig, _> = pdbridge_common::config::load(sources);
    std::fs::remove_file(&file).unwrap();
    let config = config.map_err(|e| e.to_string())?;
    let per_head_kv = per_head_kv(&json!({}), architecture);
    let profile = ModelProfile { architecture: architecture.into(), num_layers: 2, per_head_kv, ..Default::default() };
    Ok(command(&config, &profile, 8000, role).as_std().get_args().map(|a| a.to_string_lossy().into_owned()).collect())
}

#[test]
fn plugin_settings_reach_vllm_as_its_connector_extra_config() {
    let toml = "model = \"m\"\n[plugin]\nblocks_per_call = 32\ndense_weights = true\n";
    let args = vllm_args(toml, "LlamaForCausalLM").unwrap();
    let at = args.iter().position(|a| a == "--kv-transfer-config").unwrap();
    let kv_transfer: serde_json::Value = serde_json::from_str(&args[at + 1]).unwrap();
    assert_eq!(
        kv_transfer["kv_connector_extra_config"],
        json!({"blocks_per_call": 32, "dense_weights": true, "route": "reconstruct"})
    );
}

#[test]
fn the_route_decides_whether_vllm_captures() {
    let route = |toml: &str, architecture: &str| {
        let args = vllm_args(&format!("model = \"m\"\n{toml}"), architecture).unwrap();
        let at = args.iter().position(|a| a == "--kv-transfer-config").unwrap();
        let extra: serde_json::Value = serde_json::from_str(&args[at + 1]).unwrap();
        let captures = args.contains(&"--speculative-config".to_owned());
        (extra["kv_connector_extra_config"]["route"].as_str().unwrap().to_owned(), captures, args)
    };
    // auto: vLLM's own K/V on CUDA, where they are per-head; the bit-exact capture on the CPU.
    let (kv, captures, args) = route("device = \"cuda\"", "LlamaForCausalLM");
    assert_eq!((kv.as_str(), captures), ("kv", false));
    assert!(!args.contains(&"--enforce-eager".to_owned()), "a GPU keeps vLLM's own mode: {args:?}");
    assert_eq!(route("", "LlamaForCausalLM").0, "reconstruct");
    assert_eq!(route("device = \"cuda\"", "DeepseekV41ForCausalLM").0, "reconstruct");
    assert_eq!(route("device = \"cuda\"\nroute = \"reconstruct\"", "LlamaForCausalLM").0, "reconstruct");
    // Asked for on the CPU: no capture, eager (vLLM-CPU's compile buys a prefill nothing).
    let (kv, captures, args) = route("route = \"kv\"", "LlamaForCausalLM");
    assert_eq!((kv.as_str(), captures), ("kv", false));
    assert!(args.contains(&"--enforce-eager".to_owned()), "{args:?}");
    let staged = vllm_args("model = \"m\"\nroute = \"kv\"\npipeline_parallel_size = 2", "LlamaForCausalLM");
    assert!(staged.unwrap_err().contains("engine.route"));
}

#[test]
fn a_latent_or_recurrent_cache_is_not_per_head_kv() {
    assert!(per_head_kv(&json!({"layer_types": ["sliding_attention", "full_attention"]}), "Gemma3ForCausalLM"));
    assert!(!per_head_kv(&json!({"kv_lora_rank": 512}), "DeepseekV3ForCausalLM"));
    assert!(!per_head_kv(&json!({"layer_types": ["linear_attention", "full_attention"]}), "Qwen3NextForCausalLM"));
    assert!(!per_head_kv(&json!({}), "DeepseekV41ForCausalLM"));
}

#[test]
fn deepseek_v41_runs_whole_prompts_and_plain_tokenization() {
    let args = |architecture| vllm_args("model = \"m\"\nmax_model_len = 8192", architecture).unwrap().join(" ");
    assert!(
        args("DeepseekV41ForCausalLM").contains(
            r#"--max-num-batched-tokens 8192 --tokenizer-mode hf --hf-overrides {"quantization_config": null}"#
        )
    );
    assert!(!args("LlamaForCausalLM").contains("--max-num-batched-tokens"));
    // On CUDA vLLM's own class: chunked, the checkpoint's quantization on.
    let cuda = vllm_args("model = \"m\"\ndevice = \"cuda\"", "DeepseekV41ForCausalLM").unwrap().join(" ");
    assert!(!cuda.contains("--max-num-batched-tokens") && !cuda.contains("--hf-overrides"), "{cuda}");
    let tpu = vllm_args("model = \"m\"\ndevice = \"tpu\"", "DeepseekV41ForCausalLM").unwrap_err();
    assert!(tpu.contains("config key `device`") && tpu.contains("tpu"), "{tpu}");
    // Its rope is the decoder's by construction: the profile lists none to compare.
    let folder = std::env::temp_dir().join(format!("pdb-engine-v41-model-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::write(folder.join(name), "{}").unwrap();
    }
    let config = |architecture: &str| {
        json!({"architectures": [architecture], "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
               "vocab_size": 32, "rope_theta": 1e4})
    };
    std::fs::write(folder.join("config.json"), config("DeepseekV41ForCausalLM").to_string()).unwrap();
    assert!(ModelProfile::read(&folder).unwrap().ropes.is_empty());
    // As published: the text model's keys under text_config.
    let mut text = config("DeepseekV41ForCausalLM");
    let architectures = text.as_object_mut().unwrap().remove("architectures").unwrap();
    let nested = json!({"architectures": architectures, "text_config": text});
    std::fs::write(folder.join("config.json"), nested.to_string()).unwrap();
    let profile = ModelProfile::read(&folder).unwrap();
    assert_eq!(
        (profile.architecture.as_str(), profile.num_layers, profile.hidden_size),
        ("DeepseekV41ForCausalLM", 2, 64)
    );
    std::fs::write(folder.join("config.json"), config("LlamaForCausalLM").to_string()).unwrap();
    assert_eq!(ModelProfile::read(&folder).unwrap().ropes.len(), 2);
    std::fs::remove_dir_all(&folder).unwrap();
}

#[test]
fn pipeline_stages_start_vllm_without_the_drafter() {
    let args = |toml: &str| vllm_args(toml, "LlamaForCausalLM");
    let one = args("model = \"m\"").unwrap();
    assert!(one.contains(&"--speculative-config".to_owned()) && one.contains(&"--enforce-eager".to_owned()));
    let two = args("model = \"m\"\npipeline_parallel_size = 2").unwrap();
    let at = two.iter().position(|a| a == "--pipeline-parallel-size").unwrap();
    assert_eq!(two[at + 1], "2");
    assert!(!two.contains(&"--speculative-config".to_owned()) && !two.contains(&"--enforce-eager".to_owned()));
    let hidden = args("model = \"m\"\nextra_args = [\"--pipeline-parallel-size=2\"]").unwrap_err();
    assert!(hidden.contains("set engine.pipeline_parallel_size instead"), "{hidden}");
}

#[test]
fn the_boxes_of_engine_nodes_start_one_vllm_together() {
    let toml = "model = \"m\"\npipeline_parallel_size = 2\n[nodes]\ncount = 2\nhead = \"10.0.0.1\"\n\
                head_identity = \"prefill-a\"\nstage_listen = \"0.0.0.0:7710\"\nstage_peers = [\"prefill-b\"]\n";
    let line = |role| vllm_args_as(toml, "LlamaForCausalLM", role).unwrap().join(" ");
    let (head, node) = (line(Role::Head), line(Role::Node(1)));
    let joined = "--nnodes 2 --node-rank {} --master-addr 10.0.0.1 --master-port 29500";
    assert!(
        head.starts_with("-m vllm.entrypoints.openai.api_server") && head.contains(&joined.replace("{}", "0")),
        "{head}"
    );
    assert!(node.starts_with("-m pdbridge_vllm.node") && node.contains(&joined.replace("{}", "1")), "{node}");
    assert!(node.ends_with("--headless") && !head.contains("--headless"));
    // Both run the stage route with the same connector.
    for args in [&head, &node] {
        assert!(args.contains("--pipeline-parallel-size 2") && args.contains("PdBridgeConnector"), "{args}");
    }
}

fn kinds_and_thetas(config: serde_json::Value, layers: usize) -> Vec<(String, f64)> {
    HfRope::per_layer(&config, layers).into_iter().map(|r| (r.kind, r.theta)).collect()
}

#[test]
fn rope_is_read_from_every_config_style() {
    // transformers 4: rope_scaling beside a top-level theta.
    let llama3 = json!({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}});
    let ropes = HfRope::per_layer(&llama3, 2);
    assert_eq!((ropes[1].kind.as_str(), ropes[1].theta), ("llama3", 5e5));
    assert_eq!(ropes[1].scaling, [("factor".to_owned(), 8.0)].into());
    // transformers 5: one rope_parameters holding the theta.
    let v5 = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
    assert_eq!(kinds_and_thetas(v5, 1), [("default".to_owned(), 1e6)]);
    assert_eq!(kinds_and_thetas(json!({}), 1), [("default".to_owned(), 1e4)]);
    // YaRN's `truncate` (a boolean, true when absent) is part of the model.
    let yarn = |extra: serde_json::Value| {
        let mut params = json!({"rope_type": "yarn", "factor": 32.0});
        params.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        HfRope::per_layer(&json!({"rope_scaling": params}), 1).remove(0).scaling["truncate"]
    };
    assert_eq!((yarn(json!({})), yarn(json!({"truncate": false}))), (1.0, 0.0));
}

#[test]
fn sliding_layers_keep_their_own_rope() {
    // Gemma 3, transformers 4: every 3rd layer global, the others local with their own base.
    let pattern = json!({"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}});
    let thetas: Vec<f64> = kinds_and_thetas(pattern, 4).into_iter().map(|(_, t)| t).collect();
    assert_eq!(thetas, [1e4, 1e4, 1e6, 1e4]);
    // transformers 5: rope_parameters per layer type, layer_types naming each layer's.
    let typed = json!({"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}});
    assert_eq!(kinds_and_thetas(typed, 2), [("default".to_owned(), 1e4), ("linear".to_owned(), 1e6)]);
}
