#!/usr/bin/env node
// Generates src/protocol.ts from the protocol's JSON Schema (../../schema/zsb-rpc.schema.json).
//
//   node scripts/gen-types.mjs            write src/protocol.ts        (npm run gen-types)
//   node scripts/gen-types.mjs --check    exit 1 if it is out of date  (npm run check-types)
//   --schema PATH / --output PATH         other files
//
// Only the subset of JSON Schema that zsb_rpc.protocol.schema emits is understood:
// objects with properties, enums, $ref, type arrays, oneOf, arrays and string maps.
// Anything else is an error, so a new construct in the schema cannot be mistranslated.

import { readFileSync, writeFileSync, existsSync } from "node:fs";
import { dirname, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const packageDir = resolve(here, "..");

function parseArgs(argv) {
  const options = {
    check: false,
    schema: resolve(packageDir, "../../schema/zsb-rpc.schema.json"),
    output: resolve(packageDir, "src/protocol.ts"),
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--check") options.check = true;
    else if (arg === "--schema") options.schema = resolve(argv[++i]);
    else if (arg === "--output") options.output = resolve(argv[++i]);
    else throw new Error(`unknown argument: ${arg}`);
  }
  return options;
}

const IDENTIFIER = /^[A-Za-z_$][A-Za-z0-9_$]*$/;
const PRIMITIVES = { string: "string", integer: "number", number: "number", boolean: "boolean", null: "null" };

function key(name) {
  return IDENTIFIER.test(name) ? name : JSON.stringify(name);
}

function refName(ref) {
  const prefix = "#/$defs/";
  if (!ref.startsWith(prefix)) throw new Error(`unsupported $ref ${ref}`);
  return ref.slice(prefix.length);
}

function sorted(object) {
  return Object.keys(object).sort();
}

/** JSDoc for a description and optional default; `*\/` cannot end the comment early. */
function jsdoc(indent, description, extra = []) {
  const lines = [];
  if (description) lines.push(...wrap(description.replaceAll("*/", "*\\/"), 100 - indent.length));
  lines.push(...extra);
  if (lines.length === 0) return "";
  if (lines.length === 1) return `${indent}/** ${lines[0]} */\n`;
  return `${indent}/**\n${lines.map((line) => `${indent} *${line ? " " + line : ""}`).join("\n")}\n${indent} */\n`;
}

function wrap(text, width) {
  const lines = [];
  let line = "";
  for (const word of text.split(/\s+/).filter(Boolean)) {
    if (line && line.length + 1 + word.length > width) {
      lines.push(line);
      line = word;
    } else {
      line = line ? `${line} ${word}` : word;
    }
  }
  if (line) lines.push(line);
  return lines;
}

function union(parts) {
  return [...new Set(parts)].join(" | ");
}

/** The TypeScript type of a schema (not a whole interface). */
function tsType(schema, defs) {
  if (schema.$ref) {
    const name = refName(schema.$ref);
    if (!(name in defs)) throw new Error(`$ref to a missing definition: ${schema.$ref}`);
    return name;
  }
  if (schema.enum) return union(schema.enum.map((value) => JSON.stringify(value)));
  if (schema.oneOf) return union(schema.oneOf.map((member) => tsType(member, defs)));
  if (Array.isArray(schema.type)) return union(schema.type.map((type) => tsType({ ...schema, type }, defs)));
  switch (schema.type) {
    case "array": {
      const item = tsType(schema.items ?? {}, defs);
      return IDENTIFIER.test(item) ? `${item}[]` : `Array<${item}>`;
    }
    case "object":
      if (schema.properties) throw new Error("nested object types must be $defs");
      if (schema.additionalProperties && typeof schema.additionalProperties === "object") {
        return `Record<string, ${tsType(schema.additionalProperties, defs)}>`;
      }
      return "Record<string, unknown>";
    case undefined:
      if (Object.keys(schema).every((k) => k === "description" || k === "default")) return "unknown";
      break;
    default:
      if (schema.type in PRIMITIVES) return PRIMITIVES[schema.type];
  }
  throw new Error(`unsupported schema: ${JSON.stringify(schema)}`);
}

function definition(name, schema, defs) {
  const doc = jsdoc("", schema.description);
  if (schema.type === "object" && schema.properties) {
    const required = new Set(schema.required ?? []);
    let body = "";
    for (const prop of sorted(schema.properties)) {
      const propSchema = schema.properties[prop];
      const extra = "default" in propSchema ? [`@defaultValue \`${JSON.stringify(propSchema.default)}\``] : [];
      body += jsdoc("  ", propSchema.description, extra);
      body += `  ${key(prop)}${required.has(prop) ? "" : "?"}: ${tsType(propSchema, defs)};\n`;
    }
    return `${doc}export interface ${name} {\n${body}}\n`;
  }
  return `${doc}export type ${name} = ${tsType(schema, defs)};\n`;
}

function methodMap(name, doc, section, defs, withResult) {
  let body = "";
  for (const method of sorted(section)) {
    const entry = section[method];
    const params = tsType(entry.params, defs);
    const result = withResult ? ` result: ${tsType(entry.result, defs)};` : "";
    body += jsdoc("  ", entry.description);
    body += `  ${JSON.stringify(method)}: { params: ${params};${result} };\n`;
  }
  return `${jsdoc("", doc)}export interface ${name} {\n${body}}\n`;
}

function generate(schema, schemaLabel) {
  const defs = schema.$defs ?? {};
  const out = [];
  out.push(
    `// Generated by scripts/gen-types.mjs from ${schemaLabel}; do not edit by hand.\n` +
      "// Regenerate with `npm run gen-types` (after `python -m zsb_rpc.protocol.schema` when the protocol changed);\n" +
      "// `npm run check-types` fails when this file is out of date.\n",
  );
  out.push(`${jsdoc("", "Version of the protocol these types describe.")}export const PROTOCOL_VERSION = ${JSON.stringify(schema.protocolVersion)};\n`);
  for (const name of sorted(defs)) out.push(definition(name, defs[name], defs));
  out.push(methodMap("RequestMap", "Every request: method name to params and result.", schema.requests ?? {}, defs, true));
  out.push(methodMap("ClientNotificationMap", "Notifications a client sends.", schema.clientNotifications ?? {}, defs, false));
  out.push(methodMap("ServerNotificationMap", "Notifications the server sends.", schema.serverNotifications ?? {}, defs, false));
  out.push(
    "export type RequestMethod = keyof RequestMap;\n" +
      "export type ClientNotificationMethod = keyof ClientNotificationMap;\n" +
      "export type ServerNotificationMethod = keyof ServerNotificationMap;\n",
  );

  const requests = schema.requests ?? {};
  let paramsRequired = "";
  for (const method of sorted(requests)) paramsRequired += `  ${JSON.stringify(method)}: ${requests[method].paramsRequired},\n`;
  out.push(
    `${jsdoc("", "Whether a request must carry params (an object, possibly empty).")}` +
      `export const PARAMS_REQUIRED: { readonly [M in RequestMethod]: boolean } = {\n${paramsRequired}};\n`,
  );

  const errors = schema.errors ?? {};
  const codes = Object.values(errors).sort((a, b) => b.code - a.code);
  let constants = "";
  let descriptions = "";
  for (const error of codes) {
    constants += jsdoc("  ", error.description);
    constants += `  ${error.name}: ${error.code},\n`;
    descriptions += `  [${error.code}]: ${JSON.stringify(error.description)},\n`;
  }
  out.push(`${jsdoc("", "Every error code of the protocol, by name.")}export const ErrorCodes = {\n${constants}} as const;\n`);
  out.push("export type ErrorCode = (typeof ErrorCodes)[keyof typeof ErrorCodes];\n");
  out.push(
    `${jsdoc("", "What each error code means.")}` +
      `export const ERROR_DESCRIPTIONS: { readonly [code: number]: string } = {\n${descriptions}};\n`,
  );
  return out.join("\n");
}

function main() {
  const options = parseArgs(process.argv.slice(2));
  const schema = JSON.parse(readFileSync(options.schema, "utf8"));
  const label = relative(packageDir, options.schema).split("\\").join("/");
  const text = generate(schema, label);
  const outputLabel = relative(process.cwd(), options.output) || options.output;
  if (options.check) {
    const current = existsSync(options.output) ? readFileSync(options.output, "utf8") : "";
    if (current !== text) {
      console.error(`${outputLabel} is out of date with ${label}; fix it with: npm run gen-types (in clients/typescript)`);
      process.exit(1);
    }
    return;
  }
  writeFileSync(options.output, text);
}

main();
