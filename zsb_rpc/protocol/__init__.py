"""The wire contract of zsb-rpc: data only.

Nothing in this package imports the rest of zsb_rpc, so clients, the schema
generator and the server all share one description of the protocol.
"""

PROTOCOL_VERSION = "1"
