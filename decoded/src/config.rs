//! decoded's configuration (see `deploy/examples/decoded.toml`).

use pdbridge_common::config::{ConfigError, LogConfig, ServerConfig, Validate};
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    #[serde(default)]
    pub log: LogConfig,
}

impl Validate for Config {
    fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()
    }
}
