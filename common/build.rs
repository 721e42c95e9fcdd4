//! Compiles the protos with a pure-Rust protobuf compiler (no system `protoc`): `bridge.proto`
//! (the daemons' gRPC contract; its descriptor set is kept for server reflection) and
//! `engine.proto` (the contracts with the engines), and generates their
//! proto3-JSON serde impls with pbjson from the same descriptors.

use std::{env, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not baked in when it is compiled: a target dir shared by two
    // checkouts must not compile one checkout's proto for the other.
    let proto_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let bridge = proto_dir.join("bridge.proto");
    let engine = proto_dir.join("engine.proto");
    for proto in [&bridge, &engine] {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    let out = PathBuf::from(env::var("OUT_DIR")?);

    let bridge_fds = protox::compile([&bridge], [&proto_dir])?;
    std::fs::write(out.join("bridge_descriptor.bin"), bridge_fds.encode_to_vec())?;
    // engine.proto and what it imports (bridge.proto): every type pbjson must know.
    let all_fds = protox::compile([&engine], [&proto_dir])?;

    tonic_prost_build::configure()
        // Bulk payloads decode as `Bytes`, sharing the receive buffer (no copy).
        .bytes(".pdbridge.v1.Shard.payload")
        .bytes(".pdbridge.v1.BundleChunk.data")
        // Ordered maps encode deterministically, so a spec hashes the same everywhere.
        .btree_map(".")
        .compile_fds(bridge_fds)?;

    // The engine package, its references to pdbridge.v1 resolved to `crate::proto`. prost needs
    // bridge.proto's descriptors too and writes its module again: into a folder of its own, unused.
    let engine_out = out.join("engine");
    std::fs::create_dir_all(&engine_out)?;
    tonic_prost_build::configure()
        .out_dir(&engine_out)
        .btree_map(".")
        .extern_path(".pdbridge.v1", "crate::proto")
        .compile_fds(all_fds.clone())?;

    // proto3 JSON for both packages, printed with the proto field names (the adapter's wire).
    let descriptors = all_fds.encode_to_vec();
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        .out_dir(&out)
        .btree_map(["."])
        .preserve_proto_field_names()
        .build(&[".pdbridge.v1"])?;
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        .out_dir(&out)
        .btree_map(["."])
        .preserve_proto_field_names()
        .extern_path(".pdbridge.v1", "crate::proto")
        .build(&[".pdbridge.engine.v1"])?;
    Ok(())
}
