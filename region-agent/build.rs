//! Generates the Envoy rate limit service (v3 subset) server and client from `proto/` into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/envoy_rls_v3_subset.proto"], &["proto"])?;
    Ok(())
}
