// A client of the zsb-rpc sandbox server: spawns it, speaks JSON-RPC 2.0 over its
// stdin/stdout with vscode-jsonrpc, and maps sessions, streamed runs and
// AbortSignal cancellation onto the protocol.

import { spawn, type ChildProcess } from "node:child_process";
import {
  CancellationTokenSource,
  ErrorCodes as JsonRpcErrorCodes,
  ResponseError,
  StreamMessageReader,
  StreamMessageWriter,
  createMessageConnection,
  type MessageConnection,
} from "vscode-jsonrpc/node";

import {
  ErrorCodes,
  type CapabilitiesParams,
  type CapabilitiesResult,
  type Command,
  type RequestMap,
  type RequestMethod,
  type RunOutputNotification,
  type RunParams,
  type RunResourcesNotification,
  type RunResult,
  type SessionCloseResult,
  type SessionOpenParams,
  type SessionOpenResult,
  type WrapParams,
  type WrapResult,
} from "./protocol.js";

/** An error response of the server (or of the connection to it), with its JSON-RPC code. */
export class ZsbRpcError extends Error {
  /** The JSON-RPC error code: one of `ErrorCodes`, or vscode-jsonrpc's own (e.g. -32097 when the server exited). */
  readonly code: number;
  /** The error's `data`, e.g. `{ field: "params.timeout" }` for invalid params; undefined when none. */
  readonly data: unknown;

  constructor(code: number, message: string, data?: unknown) {
    super(message);
    this.name = "ZsbRpcError";
    this.code = code;
    this.data = data ?? undefined;
  }
}

export interface StartOptions {
  /** Program to run. Default: `$ZSB_RPC_PYTHON`, else `python3`. */
  command?: string;
  /** Its arguments. Default `["-m", "zsb_rpc"]`; pass `[]` for the `zsb-rpc` console script. */
  args?: string[];
  /** The server's whole environment (not merged). Default: this process's environment. */
  env?: NodeJS.ProcessEnv;
  /** The server's working directory. Default: this process's. */
  cwd?: string;
  /** What to do with the server's stderr (its log): default `"inherit"`; a function receives each chunk. */
  stderr?: "inherit" | "ignore" | ((chunk: string) => void);
}

export interface CallOptions {
  /** Aborting sends `$/cancelRequest`; the call then rejects with a ZsbRpcError of code -32800. */
  signal?: AbortSignal;
}

export interface RunOptions extends Omit<RunParams, "sessionId" | "command" | "runId">, CallOptions {
  /** Each chunk of standard output, as it arrives (before the result). */
  onStdout?: (data: string) => void;
  /** Each chunk of standard error, as it arrives (before the result). */
  onStderr?: (data: string) => void;
  /** Each `run/output` notification of this run, whole. */
  onOutput?: (notification: RunOutputNotification) => void;
  /** Each `run/resources` notification of this run. */
  onResources?: (notification: RunResourcesNotification) => void;
}

export interface WrapOptions extends Omit<WrapParams, "sessionId" | "command">, CallOptions {}

export interface ExitStatus {
  code: number | null;
  signal: NodeJS.Signals | null;
}

interface RunListeners {
  onStdout?: (data: string) => void;
  onStderr?: (data: string) => void;
  onOutput?: (notification: RunOutputNotification) => void;
  onResources?: (notification: RunResourcesNotification) => void;
  failure?: { error: unknown };
}

/** How long after the server's stdout closed its last messages may still be in vscode-jsonrpc's queue. */
const DRAIN_MS = 200;

export class ZsbClient {
  /** The server's child process. */
  readonly process: ChildProcess;
  /** Settles when the server has exited and its pipes are closed. */
  readonly exited: Promise<ExitStatus>;
  private readonly connection: MessageConnection;
  private readonly runs = new Map<string | number, RunListeners>();
  private runCounter = 0;
  private exitStatus: ExitStatus | undefined;
  private disposing: Promise<ExitStatus> | undefined;

  private constructor(child: ChildProcess) {
    this.process = child;
    const stdout = child.stdout!;
    const stdin = child.stdin!;
    this.connection = createMessageConnection(new StreamMessageReader(stdout), new StreamMessageWriter(stdin));
    this.connection.onNotification("run/output", (notification: RunOutputNotification) => {
      const listeners = this.runs.get(notification.runId);
      if (!listeners) return;
      deliver(listeners, () => {
        listeners.onOutput?.(notification);
        if (notification.stream === "stdout") listeners.onStdout?.(notification.data);
        else listeners.onStderr?.(notification.data);
      });
    });
    this.connection.onNotification("run/resources", (notification: RunResourcesNotification) => {
      const listeners = this.runs.get(notification.runId);
      if (listeners) deliver(listeners, () => listeners.onResources?.(notification));
    });
    this.exited = new Promise<ExitStatus>((resolve) => {
      child.once("close", (code, signal) => {
        this.exitStatus = { code, signal };
        // The last responses may still wait in the connection's queue; let them
        // through before rejecting whatever is still pending.
        void drain(this.connection).then(() => {
          this.connection.dispose();
          resolve({ code, signal });
        });
      });
    });
    this.connection.listen();
  }

  /** Spawn the server and connect to it. Rejects when the program cannot be started. */
  static async start(options: StartOptions = {}): Promise<ZsbClient> {
    const command = options.command ?? process.env.ZSB_RPC_PYTHON ?? "python3";
    const args = options.args ?? ["-m", "zsb_rpc"];
    const stderr = options.stderr ?? "inherit";
    const child = spawn(command, args, {
      env: options.env ?? process.env,
      cwd: options.cwd,
      stdio: ["pipe", "pipe", typeof stderr === "function" ? "pipe" : stderr],
    });
    await new Promise<void>((resolve, reject) => {
      child.once("spawn", resolve);
      child.once("error", (error) => reject(new Error(`cannot start ${command}: ${error.message}`, { cause: error })));
    });
    child.on("error", () => {}); // later errors (a failed kill) surface through `exited`
    child.stdin!.on("error", () => {}); // EPIPE when the server died: requests reject instead
    if (typeof stderr === "function") {
      child.stderr!.setEncoding("utf8");
      child.stderr!.on("data", stderr);
    }
    return new ZsbClient(child);
  }

  /** The server's process id. */
  get pid(): number {
    return this.process.pid!;
  }

  /** Send any request of the protocol; errors reject as ZsbRpcError. */
  async request<M extends RequestMethod>(
    method: M,
    params?: RequestMap[M]["params"],
    options: CallOptions = {},
  ): Promise<RequestMap[M]["result"]> {
    const { signal } = options;
    if (signal?.aborted) {
      throw new ZsbRpcError(ErrorCodes.REQUEST_CANCELLED, `${method} was aborted before it was sent`);
    }
    if (this.exitStatus || this.disposing) {
      throw new ZsbRpcError(JsonRpcErrorCodes.ConnectionInactive, `the zsb-rpc server is gone; cannot send ${method}`);
    }
    const source = new CancellationTokenSource();
    const abort = () => source.cancel();
    signal?.addEventListener("abort", abort, { once: true });
    try {
      const pending =
        params === undefined
          ? this.connection.sendRequest<RequestMap[M]["result"]>(method, source.token)
          : this.connection.sendRequest<RequestMap[M]["result"]>(method, params, source.token);
      return await pending;
    } catch (error) {
      throw this.translate(error, method);
    } finally {
      signal?.removeEventListener("abort", abort);
      source.dispose();
    }
  }

  /** What this machine can enforce and how; creates nothing. */
  capabilities(params?: CapabilitiesParams, options?: CallOptions): Promise<CapabilitiesResult> {
    return this.request("capabilities", params, options);
  }

  /** Open a session (a private workspace unless `workspace` is given). */
  async openSession(params: SessionOpenParams = {}, options?: CallOptions): Promise<Session> {
    const result = await this.request("session/open", params, options);
    return new Session(this, result);
  }

  /**
   * Close the server's stdin and wait for it to exit: it kills every command,
   * removes the private workspaces, answers what is in flight and exits 0.
   * After `timeoutMs` it is killed.
   */
  dispose(options: { timeoutMs?: number } = {}): Promise<ExitStatus> {
    this.disposing ??= (async () => {
      const timeoutMs = options.timeoutMs ?? 10_000;
      this.process.stdin?.end();
      let timer: NodeJS.Timeout | undefined;
      const timedOut = new Promise<"timeout">((resolve) => {
        timer = setTimeout(() => resolve("timeout"), timeoutMs);
      });
      try {
        if ((await Promise.race([this.exited, timedOut])) === "timeout") this.process.kill("SIGKILL");
        return await this.exited;
      } finally {
        clearTimeout(timer);
      }
    })();
    return this.disposing;
  }

  /** @internal */
  streamRun(listeners: RunListeners): string {
    const runId = `run-${++this.runCounter}`;
    this.runs.set(runId, listeners);
    return runId;
  }

  /** @internal */
  endRun(runId: string): void {
    this.runs.delete(runId);
  }

  private translate(error: unknown, method: string): unknown {
    if (!(error instanceof ResponseError)) return error;
    if (error.code === JsonRpcErrorCodes.PendingResponseRejected && this.exitStatus) {
      const { code, signal } = this.exitStatus;
      const how = signal ? `signal ${signal}` : `code ${code}`;
      return new ZsbRpcError(error.code, `the zsb-rpc server exited (${how}) before answering ${method}`);
    }
    return new ZsbRpcError(error.code, error.message, error.data);
  }
}

/** An open session of a server. */
export class Session {
  readonly id: string;
  /** The workspace directory, resolved. */
  readonly workspace: string;
  readonly backend: string;
  readonly isolated: boolean;
  /** What the session asked for and does not get. */
  readonly warnings: string[];

  constructor(
    readonly client: ZsbClient,
    readonly info: SessionOpenResult,
  ) {
    this.id = info.sessionId;
    this.workspace = info.workspace;
    this.backend = info.backend;
    this.isolated = info.isolated;
    this.warnings = info.warnings;
  }

  /**
   * Run a command and wait for it. A string runs through `/bin/sh -c`, a list directly.
   * With any of the `on*` callbacks the output is streamed to them before the result
   * arrives; `signal` cancels the run (its process tree is killed).
   */
  async run(command: Command, options: RunOptions = {}): Promise<RunResult> {
    const { onStdout, onStderr, onOutput, onResources, signal, ...rest } = options;
    const params: RunParams = { ...rest, sessionId: this.id, command };
    let runId: string | undefined;
    let listeners: RunListeners | undefined;
    if (onStdout || onStderr || onOutput || onResources) {
      listeners = { onStdout, onStderr, onOutput, onResources };
      runId = this.client.streamRun(listeners);
      params.runId = runId;
    }
    try {
      const result = await this.client.request("run", params, { signal });
      if (listeners?.failure) throw listeners.failure.error;
      return result;
    } finally {
      if (runId !== undefined) this.client.endRun(runId);
    }
  }

  /** The sandboxed argv, cwd and environment of a command under this session's policy; nothing runs. */
  wrap(command: Command, options: WrapOptions = {}): Promise<WrapResult> {
    const { signal, ...rest } = options;
    return this.client.request("wrap", { ...rest, sessionId: this.id, command }, { signal });
  }

  /** Kill the session's commands and remove its private workspace. */
  close(options?: CallOptions): Promise<SessionCloseResult> {
    return this.client.request("session/close", { sessionId: this.id }, options);
  }
}

/** Run a callback of a run; the first exception fails the run once its response arrives. */
function deliver(listeners: RunListeners, callback: () => void): void {
  if (listeners.failure) return;
  try {
    callback();
  } catch (error) {
    listeners.failure = { error };
  }
}

async function drain(connection: MessageConnection): Promise<void> {
  const deadline = Date.now() + DRAIN_MS;
  while (connection.hasPendingResponse() && Date.now() < deadline) {
    await new Promise((resolve) => setImmediate(resolve));
  }
}
