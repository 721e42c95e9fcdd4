//! Compiles `proto/bridge.proto` with a pure-Rust protobuf compiler (no system
//! `protoc`) and keeps the descriptor set for gRPC server reflection.

use std::{env, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not baked in when it is compiled: a target dir shared by two
    // checkouts must not compile one checkout's proto for the other.
    let proto_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let proto = proto_dir.join("bridge.proto");
    println!("cargo:rerun-if-changed={}", proto.display());

    let fds = protox::compile([&proto], [&proto_dir])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(out.join("bridge_descriptor.bin"), fds.encode_to_vec())?;

    tonic_prost_build::configure()
        // Bulk payloads decode as `Bytes`, sharing the receive buffer (no copy).
        .bytes(".pdbridge.v1.Shard.payload")
        .bytes(".pdbridge.v1.BundleChunk.data")
        // Ordered maps encode deterministically, so a spec hashes the same everywhere.
        .btree_map(".")
        .compile_fds(fds)?;
    Ok(())
}
