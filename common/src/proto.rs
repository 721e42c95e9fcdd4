//! Generated types and services of `proto/bridge.proto` (package `pdbridge.v1`).

tonic::include_proto!("pdbridge.v1");

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

    /// The dtype's name in safetensors headers.
    pub fn safetensors_name(self) -> Option<&'static str> {
        match self {
            Dtype::Unspecified => None,
            Dtype::F32 => Some("F32"),
            Dtype::F16 => Some("F16"),
            Dtype::Bf16 => Some("BF16"),
            Dtype::U32 => Some("U32"),
            Dtype::I32 => Some("I32"),
            Dtype::U8 => Some("U8"),
        }
    }
}
