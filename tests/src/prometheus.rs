//! Debian's Prometheus (`scripts/setup-prometheus.sh` unpacks it under `var/prometheus/`) scraping
//! the daemons with `deploy/prometheus/`'s own config and rules, every second, and the dashboard's
//! queries asked of it as Grafana would ask them.

use std::{path::Path, process::Stdio, time::Duration};

use serde_json::Value;

use crate::{Reserved, Scratch, workspace_root};

pub struct Prometheus {
    pub url: String,
    _child: tokio::process::Child,
    _scratch: Scratch,
}

/// `text` with `from` replaced by `to`, which must be there: a change to the shipped config that
/// this rewrite no longer matches fails here, not as an empty dashboard.
fn rewrite(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "deploy/prometheus/prometheus.yml no longer has {from:?}");
    text.replace(from, to)
}

impl Prometheus {
    /// Scrapes prefilld's and decoded's admin listeners (`host:port`) as the shipped config's two
    /// jobs do, every second, and evaluates the shipped rules every second; ready.
    pub async fn start(prefilld_admin: &str, decoded_admin: &str) -> Prometheus {
        let root = workspace_root();
        let binary = root.join("var/prometheus/usr/bin/prometheus");
        assert!(binary.exists(), "{} is missing: run scripts/setup-prometheus.sh", binary.display());
        let deploy = root.join("deploy/prometheus");
        let shipped = std::fs::read_to_string(deploy.join("prometheus.yml")).unwrap();
        let mut config = rewrite(&shipped, "\"prefill-host:9471\"", &format!("{prefilld_admin:?}"));
        config = rewrite(&config, "\"decode-host:9470\"", &format!("{decoded_admin:?}"));
        for (from, to) in [
            ("scrape_interval: 15s", "scrape_interval: 1s"),
            ("scrape_timeout: 10s", "scrape_timeout: 1s"),
            ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ] {
            config = rewrite(&config, from, to);
        }
        config = rewrite(&config, "  - rules.yml", &format!("  - {:?}", deploy.join("rules.yml")));
        let scratch = Scratch::new("prometheus");
        let config_path = scratch.write("prometheus.yml", &config);
        let listen = Reserved::new().addr();
        let log = std::fs::File::create(scratch.0.join("prometheus.log")).unwrap();
        let child = tokio::process::Command::new(&binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", scratch.0.join("data").display()))
            .arg(format!("--web.listen-address={listen}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus { url: format!("http://{listen}"), _child: child, _scratch: scratch };
        prometheus.wait_ready(Duration::from_secs(60)).await;
        prometheus
    }

    async fn wait_ready(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let ready = reqwest::get(format!("{}/-/ready", self.url)).await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "prometheus not ready in {limit:?}:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._scratch.0.join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query's series (each with its `metric` labels), or Prometheus's error.
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let url = format!("{}/api/v1/query", self.url);
        let response = reqwest::Client::new().get(url).query(&[("query", expr)]).send().await;
        let body: Value = response.map_err(|e| e.to_string())?.json().await.map_err(|e| e.to_string())?;
        match body["status"].as_str() {
            Some("success") => Ok(body["data"]["result"].as_array().cloned().unwrap_or_default()),
            _ => Err(body.to_string()),
        }
    }
}

/// One query of a dashboard panel, with Grafana's variables resolved for a short test.
pub struct PanelQuery {
    pub panel: String,
    pub expr: String,
    /// The labels its legend shows (`{{label}}`): every series it returns must carry them.
    pub legend_labels: Vec<String>,
}

/// Every query of every panel of the dashboard at `path` (collapsed rows' panels included).
pub fn panel_queries(path: &Path) -> Vec<PanelQuery> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut panels: Vec<&Value> = Vec::new();
    let mut stack: Vec<&Value> = dashboard["panels"].as_array().map(|p| p.iter().collect()).unwrap_or_default();
    while let Some(panel) = stack.pop() {
        panels.push(panel);
        stack.extend(panel["panels"].as_array().into_iter().flatten());
    }
    let mut queries = Vec::new();
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let Some(expr) = target["expr"].as_str() else { continue };
            let legend = target["legendFormat"].as_str().unwrap_or_default();
            let legend_labels = legend
                .split("{{")
                .skip(1)
                .filter_map(|part| part.split_once("}}").map(|(label, _)| label.trim().to_owned()))
                .collect();
            queries.push(PanelQuery {
                panel: format!("{} / {}", panel["title"].as_str().unwrap_or("?"), target["refId"]),
                // A one-minute rate window holds many one-second scrapes; the range is the test's.
                expr: expr.replace("$__rate_interval", "1m").replace("$__range", "1h"),
                legend_labels,
            });
        }
    }
    queries
}
