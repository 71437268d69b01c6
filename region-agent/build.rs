//! Generates Envoy's rate limit service and rate limit quota service (v3 subsets) servers and
//! clients from `proto/` into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(
            &[
                "proto/envoy_rls_v3_subset.proto",
                "proto/envoy_rlqs_v3_subset.proto",
            ],
            &["proto"],
        )?;
    Ok(())
}
