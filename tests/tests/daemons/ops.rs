//! Operations: the deployment files verify.

use pdbridge_tests::workspace_root;

#[tokio::test]
async fn deployment_files_verify() {
    let script = workspace_root().join("deploy/check.sh");
    let output = tokio::process::Command::new("bash").arg(&script).output().await.expect("run deploy/check.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "deploy/check.sh failed:\n{text}");
    for file in
        ["pdbridge-prefilld.service", "pdbridge-decoded.service", "com.pd-bridge.decoded.plist", "pd-bridge.json"]
    {
        assert!(text.contains(file), "check.sh did not check {file}:\n{text}");
    }
}
