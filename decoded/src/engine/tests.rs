use super::*;

fn golden(name: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden").join(name)).unwrap()
}

#[test]
fn an_info_reply_completes_the_spec_with_what_the_adapter_leaves_to_decoded() {
    let reply: wire::InfoReply = serde_json::from_str(&golden("InfoReply.json")).unwrap();
    let (model, bundle, tokenizer) =
        (reply.model_id.clone(), reply.bundle_sha256.clone(), reply.tokenizer_sha256.clone());
    let info = engine_info(reply).unwrap();
    assert_eq!((info.spec.model_id.as_str(), info.spec.num_layers), (model.as_str(), 30));
    assert_eq!((&info.spec.weights_fingerprint, &info.spec.tokenizer_fingerprint), (&bundle, &tokenizer));
    assert_eq!(info.spec.spec_fingerprint.len(), 64);
    assert!(spec::unsupported(&info.spec).is_empty());
    assert_eq!(info.spec.layers[0].tensors[0].dtype(), Dtype::F32);
}

#[test]
fn a_spec_without_kinds_or_dtypes_is_refused() {
    let mut reply: wire::InfoReply = serde_json::from_str(&golden("InfoReply.json")).unwrap();
    reply.spec.as_mut().unwrap().layers[3].kind = 0;
    assert!(matches!(engine_info(reply), Err(EngineError::Protocol(e)) if e.contains("layer 3")));
    let mut reply: wire::InfoReply = serde_json::from_str(&golden("InfoReply.json")).unwrap();
    reply.spec.as_mut().unwrap().layers[2].tensors[1].extent = 0;
    assert!(
        matches!(engine_info(reply), Err(EngineError::Protocol(e)) if e.contains("layer 2 tensor values: no extent"))
    );
}

#[test]
fn a_spec_file_is_an_info_reply_in_proto3_json() {
    let dir = std::env::temp_dir().join(format!("pdb-engine-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("spec.json");
    let mut proto3: serde_json::Value = serde_json::from_str(&golden("InfoReply.json")).unwrap();
    proto3["spec"]["block_tokens"] = 16.into();
    std::fs::write(&path, proto3.to_string()).unwrap();
    let spec = Engine::fixed(&path, 16).unwrap().info().unwrap().spec.clone();
    assert_eq!((spec.num_layers, spec.layers[0].kind(), spec.input_dtype()), (30, CacheKind::Rows, Dtype::F32));
    assert!(matches!(Engine::fixed(&path, 32), Err(EngineError::Protocol(e)) if e.contains("block_tokens")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn errors_and_tokens_read_as_decoded_handles_them() {
    let reply: wire::Reply = serde_json::from_str(&golden("Reply.error.json")).unwrap();
    let Some(Answer::Error(err)) = reply.reply else { panic!("{reply:?}") };
    assert!(matches!(engine_error(err), EngineError::BlockUnusable { block: 2, .. }));
    let bad: wire::Error = serde_json::from_str(&golden("Error.json")).unwrap();
    assert!(matches!(engine_error(bad), EngineError::BadRequest(_)));

    let token: wire::Token = serde_json::from_str(&golden("Token.json")).unwrap();
    let GenerateEvent::Token { token, logprob: Some(entry), .. } = GenerateEvent::from(token) else { panic!() };
    assert_eq!(token, 19556);
    assert_eq!((entry.token.as_str(), entry.top_logprobs.len()), ("Hello", 2));
    let plain: wire::Token = serde_json::from_str(r#"{"id": 5}"#).unwrap();
    let GenerateEvent::Token { text, logprob: None, tool_calls, .. } = GenerateEvent::from(plain) else { panic!() };
    assert_eq!((text.as_str(), tool_calls.len()), ("", 0));
}
