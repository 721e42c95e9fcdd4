//! Generated types of the protos, with their proto3-JSON serde impls (pbjson): `bridge.proto`
//! (package `pdbridge.v1`, the daemons' gRPC contract) at this module's root, and
//! `engine.proto` (package `pdbridge.engine.v1`, the contracts with the engines: the decode adapter's
//! protocol, the vLLM plugin's parameters and frames, block file metadata) in
//! [`engine`].

tonic::include_proto!("pdbridge.v1");
include!(concat!(env!("OUT_DIR"), "/pdbridge.v1.serde.rs"));

/// The contracts with the engines (`proto/engine.proto`): the decode adapter's JSON lines (each the
/// proto3 JSON of a [`engine::Request`] or [`engine::Reply`], printed with the proto field names),
/// the vLLM plugin's [`engine::PluginParams`] and [`engine::PluginFrame`]s, a block file's
/// [`engine::BlockMetadata`].
// A `Reply` lives for one line; an info reply's size in it costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub mod engine {
    include!(concat!(env!("OUT_DIR"), "/engine/pdbridge.engine.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/pdbridge.engine.v1.serde.rs"));
}

/// Encoded descriptor set of `bridge.proto`, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/bridge_descriptor.bin"));

impl Dtype {
    /// Size of one element in bytes; `None` for `DTYPE_UNSPECIFIED`.
    pub fn size_bytes(self) -> Option<usize> {
        match self {
            Dtype::Unspecified => None,
            Dtype::F32 | Dtype::U32 | Dtype::I32 => Some(4),
            Dtype::F16 | Dtype::Bf16 => Some(2),
            Dtype::U8 => Some(1),
        }
    }
}

impl Route {
    /// As the verdict, the plugin's config and the metrics say it: `kv`, `reconstruct`, `exact`
    /// (empty when unspecified).
    pub fn label(self) -> &'static str {
        match self {
            Route::Unspecified => "",
            Route::Reconstruct => "reconstruct",
            Route::Kv => "kv",
            Route::Exact => "exact",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde::{Serialize, de::DeserializeOwned};

    use super::engine;

    /// A golden file parsed into its message and printed again: the same JSON.
    fn round_trip<T: Serialize + DeserializeOwned>(text: &str) -> Result<(), String> {
        let want: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let message: T = serde_json::from_str(text).map_err(|e| format!("does not parse: {e}"))?;
        let got = serde_json::to_value(&message).map_err(|e| e.to_string())?;
        if got != want {
            return Err(format!("prints differently:\n{got}\nvs the file\n{want}"));
        }
        Ok(())
    }

    /// Every file of `proto/golden/` (`Message[.example].json`, proto3 JSON as the adapter prints
    /// it) is one of engine.proto's messages and survives a round trip through it; the Python
    /// adapter's tests hold the same files to its generated classes.
    #[test]
    fn golden_files_round_trip_through_the_engine_schema() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let mut failures = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for path in &files {
            let name = path.file_name().unwrap().to_str().unwrap();
            let message = name.split('.').next().unwrap();
            let text = std::fs::read_to_string(path).unwrap();
            let result = match message {
                "Ready" => round_trip::<engine::Ready>(&text),
                "Request" => round_trip::<engine::Request>(&text),
                "Reply" => round_trip::<engine::Reply>(&text),
                "InfoRequest" => round_trip::<engine::InfoRequest>(&text),
                "InfoReply" => round_trip::<engine::InfoReply>(&text),
                "TokenizeRequest" => round_trip::<engine::TokenizeRequest>(&text),
                "TokenizeReply" => round_trip::<engine::TokenizeReply>(&text),
                "GenerateRequest" => round_trip::<engine::GenerateRequest>(&text),
                "Sampling" => round_trip::<engine::Sampling>(&text),
                "Token" => round_trip::<engine::Token>(&text),
                "Logprob" => round_trip::<engine::Logprob>(&text),
                "ToolCall" => round_trip::<engine::ToolCall>(&text),
                "GenerateSummary" => round_trip::<engine::GenerateSummary>(&text),
                "ReconstructRequest" => round_trip::<engine::ReconstructRequest>(&text),
                "ReconstructReply" => round_trip::<engine::ReconstructReply>(&text),
                "Error" => round_trip::<engine::Error>(&text),
                "PluginParams" => round_trip::<engine::PluginParams>(&text),
                "PluginFrame" => round_trip::<engine::PluginFrame>(&text),
                "PluginBlock" => round_trip::<engine::PluginBlock>(&text),
                "PluginTensor" => round_trip::<engine::PluginTensor>(&text),
                "PluginDone" => round_trip::<engine::PluginDone>(&text),
                "PluginTimings" => round_trip::<engine::PluginTimings>(&text),
                "PluginError" => round_trip::<engine::PluginError>(&text),
                "BlockMetadata" => round_trip::<engine::BlockMetadata>(&text),
                "BundleRequest" => round_trip::<engine::BundleRequest>(&text),
                "BundleReply" => round_trip::<engine::BundleReply>(&text),
                "PluginRing" => round_trip::<engine::PluginRing>(&text),
                "PluginRelease" => round_trip::<engine::PluginRelease>(&text),
                other => Err(format!("{other} is not a message of engine.proto")),
            };
            seen.insert(message.to_owned());
            if let Err(e) = result {
                failures.push(format!("{name}: {e}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        // One golden file at least per message.
        assert_eq!(seen.len(), 28, "{seen:?}");
    }

    /// A spec's proto3 JSON spells enums by name and takes the proto field names or lowerCamelCase.
    #[test]
    fn the_spec_reads_as_proto3_json() {
        let text = r#"{"numLayers": 1, "input_dtype": "DTYPE_BF16",
            "layers": [{"kind": "CACHE_KIND_ROWS", "tensors": [{"name": "keys", "dtype": "DTYPE_F32", "shape": [1, "2"]}]}]}"#;
        let spec: super::CacheSpec = serde_json::from_str(text).unwrap();
        assert_eq!((spec.num_layers, spec.input_dtype()), (1, super::Dtype::Bf16));
        assert_eq!(spec.layers[0].kind(), super::CacheKind::Rows);
        assert_eq!(spec.layers[0].tensors[0].shape, [1, 2]);
        assert!(serde_json::from_str::<super::CacheSpec>(r#"{"input_dtype": "F32"}"#).is_err());
        assert!(serde_json::from_str::<super::CacheSpec>(r#"{"no_such_field": 1}"#).is_err());
    }
}
