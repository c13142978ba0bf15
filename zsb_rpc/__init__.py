"""zsb-rpc: a JSON-RPC 2.0 server on stdio that runs commands inside an operating-system sandbox."""

__version__ = "0.1.0"
