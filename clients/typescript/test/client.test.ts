// The client against the real zsb-rpc server (no mocks): spawned with the
// repository's Python, over pipes, with real sandboxed processes.
//
// ZSB_RPC_PYTHON picks the interpreter; by default the repository's .venv.

import assert from "node:assert/strict";
import { randomInt } from "node:crypto";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { resolve } from "node:path";
import { test } from "node:test";

import { ErrorCodes, PROTOCOL_VERSION, ZsbClient, ZsbRpcError, type Session } from "../dist/index.js";

const REPO = resolve(__dirname, "../../..");
const PYTHON = process.env.ZSB_RPC_PYTHON || resolve(__dirname, "../../../.venv/bin/python");
const TEST_TIMEOUT = 30_000;

function startServer(): Promise<ZsbClient> {
  // The repository as working directory: `-m zsb_rpc` imports this checkout.
  return ZsbClient.start({ command: PYTHON, cwd: REPO });
}

async function withServer<T>(body: (client: ZsbClient) => Promise<T>): Promise<T> {
  const client = await startServer();
  try {
    return await body(client);
  } finally {
    await client.dispose({ timeoutMs: 5_000 });
  }
}

async function withSession<T>(body: (session: Session, client: ZsbClient) => Promise<T>): Promise<T> {
  return withServer(async (client) => body(await client.openSession(), client));
}

/** A unique number, so that `sleep <marker>` is findable in /proc and nowhere else. */
function marker(): string {
  return `${randomInt(1_000_000, 2_000_000)}.${String(randomInt(0, 1_000_000)).padStart(6, "0")}`;
}

/** Pids whose command line contains `text` (this process excluded). */
function processesWith(text: string): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`).includes(text)) found.push(Number(entry));
    } catch {
      // gone meanwhile
    }
  }
  return found;
}

async function waitFor(condition: () => boolean, timeoutMs: number): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) return false;
    await new Promise((done) => setTimeout(done, 20));
  }
  return true;
}

function isRpcError(code: number) {
  return (error: unknown) => {
    assert.ok(error instanceof ZsbRpcError, `expected a ZsbRpcError, got ${String(error)}`);
    assert.equal(error.code, code, `expected code ${code}: ${error.message}`);
    return true;
  };
}

test("capabilities reports the protocol, the platform and the backends", { timeout: TEST_TIMEOUT }, async () => {
  await withServer(async (client) => {
    const caps = await client.capabilities();
    assert.equal(caps.protocolVersion, PROTOCOL_VERSION);
    assert.equal(caps.platform, "linux");
    assert.ok(caps.backends.some((backend) => backend.name === "passthrough"));
    assert.ok(Array.isArray(caps.warnings));
    const withParams = await client.capabilities({ limits: { memoryBytes: 64 * 1024 * 1024 } });
    assert.equal(withParams.memory, caps.memory);
  });
});

test("open, run, wrap and close a session", { timeout: TEST_TIMEOUT }, async () => {
  await withSession(async (session) => {
    assert.match(session.id, /\S/);
    assert.ok(existsSync(session.workspace), "the private workspace exists while open");

    const shell = await session.run("echo hello; echo oops >&2; exit 3");
    assert.equal(shell.exitCode, 3);
    assert.equal(shell.stdout, "hello\n");
    assert.equal(shell.stderr, "oops\n");
    assert.equal(shell.timedOut, false);

    const direct = await session.run(["printf", "%s|", "a b", "$HOME"], { env: { X: "1" } });
    assert.equal(direct.stdout, "a b|$HOME|");

    const input = await session.run("cat", { input: "from stdin" });
    assert.equal(input.stdout, "from stdin");

    const wrapped = await session.wrap(["echo", "hi"]);
    assert.ok(wrapped.argv.length >= 2 && wrapped.argv.at(-1) === "hi");
    assert.equal(wrapped.cwd, session.workspace);

    const closed = await session.close();
    assert.equal(closed.sessionId, session.id);
    assert.equal(closed.removedWorkspace, true);
    assert.equal(existsSync(session.workspace), false);
    await assert.rejects(session.run("true"), isRpcError(ErrorCodes.SESSION_NOT_FOUND));
  });
});

test("server errors reject with ZsbRpcError carrying code, message and data", { timeout: TEST_TIMEOUT }, async () => {
  await withSession(async (session, client) => {
    await assert.rejects(session.run("true", { timeout: -1 }), (error: unknown) => {
      assert.ok(error instanceof ZsbRpcError);
      assert.equal(error.code, ErrorCodes.INVALID_PARAMS);
      assert.match(error.message, /^params\.timeout: /);
      assert.deepEqual(error.data, { field: "params.timeout" });
      return true;
    });
    // Unknown fields are refused, not ignored.
    await assert.rejects(
      client.request("session/close", { sessionId: session.id, bogus: 1 } as never),
      (error: unknown) => error instanceof ZsbRpcError && error.code === ErrorCodes.INVALID_PARAMS && /bogus/.test(error.message),
    );
    await assert.rejects(
      client.request("session/close", { sessionId: "s-does-not-exist" }),
      isRpcError(ErrorCodes.SESSION_NOT_FOUND),
    );
  });
});

test("streamed output arrives before the result and joins to the same stdout and stderr", { timeout: TEST_TIMEOUT }, async () => {
  await withSession(async (session) => {
    const events: string[] = [];
    const stdout: string[] = [];
    const stderr: string[] = [];
    const script = "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.05; done; printf 'é€😀 end'";
    const result = await session.run(script, {
      onStdout: (data) => {
        events.push("stdout");
        stdout.push(data);
      },
      onStderr: (data) => {
        events.push("stderr");
        stderr.push(data);
      },
    });
    events.push("result");
    assert.ok(stdout.length >= 2, `several stdout chunks, got ${stdout.length}`);
    assert.ok(stderr.length >= 2, `several stderr chunks, got ${stderr.length}`);
    assert.equal(events.at(-1), "result");
    assert.equal(events.indexOf("result"), events.length - 1, "no chunk after the result");
    assert.equal(stdout.join(""), result.stdout);
    assert.equal(stderr.join(""), result.stderr);
    assert.equal(result.stdout, "out1\nout2\nout3\nout4\nout5\né€😀 end");

    // Concurrent runs on one server each get their own chunks.
    const seen: [string[], string[]] = [[], []];
    const [a, b] = await Promise.all([
      session.run("for i in 1 2 3; do echo a$i; sleep 0.02; done", { onStdout: (d) => seen[0].push(d) }),
      session.run("for i in 1 2 3; do echo b$i; sleep 0.02; done", { onStdout: (d) => seen[1].push(d) }),
    ]);
    assert.equal(seen[0].join(""), a.stdout);
    assert.equal(seen[1].join(""), b.stdout);
    assert.equal(a.stdout, "a1\na2\na3\n");
    assert.equal(b.stdout, "b1\nb2\nb3\n");
  });
});

test("an AbortSignal cancels a run: -32800, and its processes are gone", { timeout: TEST_TIMEOUT }, async () => {
  await withSession(async (session) => {
    const mark = marker();
    const controller = new AbortController();
    const running = session.run(["sleep", mark], { signal: controller.signal });
    running.catch(() => {}); // asserted below
    assert.ok(await waitFor(() => processesWith(mark).length > 0, 10_000), "the command started");
    controller.abort();
    await assert.rejects(running, isRpcError(ErrorCodes.REQUEST_CANCELLED));
    assert.ok(await waitFor(() => processesWith(mark).length === 0, 5_000), `still alive: ${processesWith(mark)}`);

    // The session goes on serving.
    assert.equal((await session.run("echo still here")).stdout, "still here\n");

    // A signal aborted before the call sends nothing and rejects the same way.
    await assert.rejects(session.run("true", { signal: AbortSignal.abort() }), isRpcError(ErrorCodes.REQUEST_CANCELLED));
  });
});

test("dispose() closes stdin: the server kills its commands, removes workspaces and exits 0", { timeout: TEST_TIMEOUT }, async () => {
  const client = await startServer();
  const pid = client.pid;
  const mark = marker();
  let workspace = "";
  let inFlight: Promise<unknown> | undefined;
  try {
    const session = await client.openSession();
    workspace = session.workspace;
    inFlight = session.run(["sleep", mark]);
    inFlight.catch(() => {}); // asserted below
    assert.ok(await waitFor(() => processesWith(mark).length > 0, 10_000), "the command started");
  } finally {
    const status = await client.dispose({ timeoutMs: 10_000 });
    assert.deepEqual(status, { code: 0, signal: null });
  }
  assert.equal(existsSync(`/proc/${pid}`), false, "the server process is gone");
  assert.deepEqual(processesWith(mark), []);
  assert.equal(existsSync(workspace), false, "the private workspace was removed");
  // The request in flight got its one answer: its session was closed under it.
  await assert.rejects(inFlight!, isRpcError(ErrorCodes.SESSION_CLOSED));
  // Nothing more can be sent.
  await assert.rejects(client.capabilities(), ZsbRpcError);
  // Disposing again is harmless.
  assert.deepEqual(await client.dispose(), { code: 0, signal: null });
});

test("a server that cannot be started rejects start()", { timeout: TEST_TIMEOUT }, async () => {
  await assert.rejects(ZsbClient.start({ command: resolve(REPO, "no-such-python") }), /cannot start/);
});
