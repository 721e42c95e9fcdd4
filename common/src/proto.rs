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
}
