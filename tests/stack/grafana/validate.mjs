#!/usr/bin/env node
// Validates Grafana dashboard JSON files against the schema Grafana itself publishes in the npm
// package @grafana/schema (the version pinned in package.json / package-lock.json).
//
//   node validate.mjs FILE...
//
// The package ships the schema as TypeScript types; ts-json-schema-generator turns them into JSON
// Schema at every run (a few seconds) and ajv checks each file against it:
//   - the whole document against the `Dashboard` type (unknown fields are errors: the generated
//     schema sets additionalProperties false on every interface);
//   - every panel against `Panel`, or `RowPanel` when its type is "row" (so an error points at the
//     field that is wrong instead of at the Panel | RowPanel union);
//   - every panel's `options` against the `Options` type of its panel plugin, and its
//     `fieldConfig.defaults.custom` against that plugin's `FieldConfig` type, where the package
//     publishes them (raw/composable/<type>/panelcfg); a panel type without a published schema is
//     an error, so a typo in `type` cannot slip through.
// Prints one line per error (file, JSON pointer, message) and "FILE: ok" per valid file; exits
// 0 when every file is valid, 1 when any is not, 2 on a usage or setup error.

import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));

function die(message) {
  console.error(`validate.mjs: ${message}`);
  process.exit(2);
}

let Ajv, addFormats, createGenerator;
try {
  Ajv = require("ajv");
  addFormats = require("ajv-formats");
  ({ createGenerator } = require("ts-json-schema-generator"));
} catch (e) {
  die(`${e.message}\nrun 'npm ci' in ${here} first`);
}

const schemaRoot = path.join(path.dirname(require.resolve("@grafana/schema/package.json")), "dist", "types", "raw");
const schemaVersion = require("@grafana/schema/package.json").version;

function generate(file, type) {
  return createGenerator({ path: file, type, skipTypeCheck: true, expose: "export" }).createSchema(type);
}

function newAjv() {
  // strictTypes off: the generator writes unions as `type: [...]` lists that ajv's strict mode
  // would only warn about; every other strict check stays on.
  // (`deprecated`, which the generator copies from @deprecated comments, is an annotation ajv knows.)
  const ajv = new Ajv({ allErrors: true, strict: true, strictTypes: false, verbose: false });
  addFormats(ajv);
  return ajv;
}

const dashboardTypes = path.join(schemaRoot, "dashboard", "x", "types.gen.d.ts");
if (!fs.existsSync(dashboardTypes)) {
  die(`${dashboardTypes} is missing: the layout of @grafana/schema ${schemaVersion} differs from what this script knows`);
}
const ajv = newAjv();
try {
  ajv.addSchema(generate(dashboardTypes, "Dashboard"), "dashboard");
} catch (e) {
  die(`cannot make a JSON Schema of ${dashboardTypes}: ${e.message}`);
}
const validators = {
  dashboard: ajv.getSchema("dashboard"),
  panel: ajv.getSchema("dashboard#/definitions/Panel"),
  row: ajv.getSchema("dashboard#/definitions/RowPanel"),
};
for (const [name, v] of Object.entries(validators)) {
  if (!v) die(`no '${name}' type in ${dashboardTypes}`);
}

// The schemas of panel plugins, generated on first use: type -> {options, custom} validators (or null).
const plugins = new Map();
function pluginValidators(type) {
  if (!plugins.has(type)) {
    const file = path.join(schemaRoot, "composable", type, "panelcfg", "x", "types.gen.d.ts");
    let found = null;
    if (/^[a-z0-9-]+$/.test(type) && fs.existsSync(file)) {
      const source = fs.readFileSync(file, "utf8");
      const own = newAjv();
      found = {};
      for (const [key, typeName] of [["options", "Options"], ["custom", "FieldConfig"]]) {
        if (new RegExp(`export (interface|type) ${typeName}\\b`).test(source)) {
          try {
            found[key] = own.compile(generate(file, typeName));
          } catch (e) {
            die(`cannot make a JSON Schema of ${typeName} in ${file}: ${e.message}`);
          }
        }
      }
    }
    plugins.set(type, found);
  }
  return plugins.get(type);
}

function describe(error) {
  const where = error.instancePath || "/";
  const p = error.params || {};
  let detail = "";
  if (p.additionalProperty !== undefined) detail = `: '${p.additionalProperty}'`;
  else if (p.allowedValues !== undefined) detail = `: ${JSON.stringify(p.allowedValues)}`;
  else if (p.allowedValue !== undefined) detail = `: ${JSON.stringify(p.allowedValue)}`;
  return `${where}: ${error.message}${detail}`;
}

function check(validate, value, prefix, errors) {
  if (!validate(value)) {
    for (const e of validate.errors) errors.push(describe({ ...e, instancePath: prefix + e.instancePath }));
  }
}

function validateDashboard(doc) {
  const errors = [];
  const structural = [];
  check(validators.dashboard, doc, "", structural);
  // The union Panel | RowPanel makes ajv report both branches for a bad panel: those errors are
  // replaced by the ones of the branch the panel's type picks (checked below, for every panel).
  errors.push(...structural.filter((e) => !/^\/panels\/\d+/.test(e)));
  const panelsFailed = structural.length > errors.length;
  const panels = [];
  if (doc && typeof doc === "object" && Array.isArray(doc.panels)) {
    doc.panels.forEach((panel, i) => {
      panels.push([panel, `/panels/${i}`, panel && panel.type === "row"]);
      if (panel && panel.type === "row" && Array.isArray(panel.panels)) {
        panel.panels.forEach((inner, j) => panels.push([inner, `/panels/${i}/panels/${j}`, false]));
      }
    });
  }
  const before = errors.length;
  for (const [panel, where, isRow] of panels) {
    check(isRow ? validators.row : validators.panel, panel, where, errors);
    if (isRow || !panel || typeof panel !== "object" || typeof panel.type !== "string") continue;
    const plugin = pluginValidators(panel.type);
    if (plugin === null) {
      errors.push(`${where}/type: @grafana/schema ${schemaVersion} publishes no schema for panel type '${panel.type}'`);
      continue;
    }
    if (plugin.options) check(plugin.options, panel.options ?? {}, `${where}/options`, errors);
    const custom = panel.fieldConfig?.defaults?.custom;
    if (plugin.custom && custom !== undefined) check(plugin.custom, custom, `${where}/fieldConfig/defaults/custom`, errors);
  }
  if (panelsFailed && errors.length === before) {
    errors.push("/panels: does not match the Panel | RowPanel union");
  }
  return [...new Set(errors)]; // a row's panels are checked by the row's schema and on their own

}

const files = process.argv.slice(2);
if (files.length === 0 || files.includes("-h") || files.includes("--help")) {
  console.error("usage: node validate.mjs DASHBOARD.json...");
  process.exit(files.length === 0 ? 2 : 0);
}
let failed = 0;
for (const file of files) {
  let doc;
  try {
    doc = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (e) {
    console.log(`${file}: ${e.message}`);
    failed++;
    continue;
  }
  const errors = validateDashboard(doc);
  if (errors.length === 0) {
    console.log(`${file}: ok (@grafana/schema ${schemaVersion})`);
  } else {
    failed++;
    for (const e of errors) console.log(`${file}: ${e}`);
  }
}
process.exit(failed ? 1 : 0);
