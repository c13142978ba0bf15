export {
  ZsbClient,
  Session,
  ZsbRpcError,
  type StartOptions,
  type CallOptions,
  type RunOptions,
  type WrapOptions,
  type ExitStatus,
} from "./client.js";
export * from "./protocol.js";
