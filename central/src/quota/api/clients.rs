//! Who may call the reservation API (`--quota-clients FILE`): each
//! client's bearer token or mTLS identity and the tenants it may act for
//! (see the API's header, "Authentication").

use std::path::Path;

use serde::Deserialize;

/// Who may act for which tenants (`--quota-clients`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaClients {
    pub clients: Vec<QuotaClient>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaClient {
    #[serde(default)]
    pub token: Option<String>,
    /// The node id an mTLS certificate names.
    #[serde(default)]
    pub identity: Option<String>,
    pub tenants: Vec<String>,
}

impl QuotaClients {
    pub fn load(path: &Path) -> Result<QuotaClients, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let c: QuotaClients =
            serde_norway::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        for (i, cl) in c.clients.iter().enumerate() {
            if cl.token.is_none() == cl.identity.is_none() {
                return Err(format!(
                    "{}: clients[{i}]: exactly one of `token` or `identity`",
                    path.display()
                ));
            }
        }
        Ok(c)
    }
}

/// The tenants a caller may act for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Grant {
    All,
    Tenants(Vec<String>),
}

impl Grant {
    pub(super) fn allows(&self, tenant: &str) -> bool {
        match self {
            Grant::All => true,
            Grant::Tenants(t) => t.iter().any(|x| x == tenant || x == "*"),
        }
    }
}
