// Validates Kubernetes objects against the API's JSON schemas (the
// validators the kubernetes-models package compiles from the OpenAPI spec),
// and also rejects fields the schema does not know (a typo such as
// `readinesProbe` would otherwise pass: the schemas allow extra fields).
//
//   node validate.js NODE_MODULES FILE.json...
//
// Each FILE holds a JSON array of objects. Prints one line per object and
// exits 1 when any is invalid or of an unknown kind.
'use strict';

const fs = require('fs');
const path = require('path');

// apps/v1 + StatefulSet -> IoK8sApiAppsV1StatefulSet; v1 + Service ->
// IoK8sApiCoreV1Service; networking.k8s.io/v1 -> IoK8sApiNetworkingV1...
function schemaName(apiVersion, kind) {
  const parts = apiVersion.split('/');
  const group = parts.length === 1 ? 'core' : parts[0].split('.')[0];
  const version = parts[parts.length - 1];
  const cap = (s) => s.charAt(0).toUpperCase() + s.slice(1);
  return `IoK8sApi${cap(group)}${cap(version)}${kind}`;
}

// A view of `value` that records every property path the validator reads.
// The compiled validators read each property their schema defines (and
// iterate maps), so a path never read is a field the schema lacks.
function tracked(value, where, seen) {
  if (value === null || typeof value !== 'object') return value;
  return new Proxy(value, {
    get(target, key, receiver) {
      const child = Reflect.get(target, key, receiver);
      if (typeof key !== 'string') return child;
      seen.add(`${where}/${key}`);
      return tracked(child, `${where}/${key}`, seen);
    },
  });
}

function unknownFields(value, where, seen, out) {
  if (value === null || typeof value !== 'object') return;
  for (const key of Object.keys(value)) {
    const at = `${where}/${key}`;
    if (!Array.isArray(value) && !seen.has(at)) {
      out.push(at);
      continue;  // its own fields are unknown too; name only the top one
    }
    unknownFields(value[key], at, seen, out);
  }
}

function main(argv) {
  if (argv.length < 2) {
    console.error('usage: node validate.js NODE_MODULES FILE.json...');
    return 2;
  }
  const schemas = path.resolve(argv[0], 'kubernetes-models', '_schemas');
  if (!fs.existsSync(schemas)) {
    console.error(`validate.js: no ${schemas}: run tools/setup.sh (npm ci)`);
    return 2;
  }
  let failures = 0;
  let checked = 0;
  for (const file of argv.slice(1)) {
    const objects = JSON.parse(fs.readFileSync(file, 'utf8'));
    for (const object of objects) {
      const label = `${path.basename(file)}: ${object.kind}/` +
          `${object.metadata && object.metadata.name}`;
      const module = path.join(
          schemas, `${schemaName(object.apiVersion, object.kind)}.js`);
      if (!fs.existsSync(module)) {
        console.log(`FAIL ${label}: no schema for ${object.apiVersion} ` +
                    `${object.kind}`);
        ++failures;
        continue;
      }
      const {validate} = require(module);
      const seen = new Set();
      const valid = validate(tracked(object, '', seen));
      const problems = [];
      if (!valid) {
        for (const error of validate.errors) {
          problems.push(`${error.instancePath || '/'} ${error.keyword} ` +
                        JSON.stringify(error.params));
        }
      }
      const unknown = [];
      unknownFields(object, '', seen, unknown);
      for (const at of unknown) problems.push(`${at}: unknown field`);
      ++checked;
      if (problems.length > 0) {
        ++failures;
        console.log(`FAIL ${label}`);
        for (const problem of problems) console.log(`  ${problem}`);
      } else {
        console.log(`ok   ${label}`);
      }
    }
  }
  console.log(`${checked} objects checked, ${failures} invalid`);
  return failures === 0 && checked > 0 ? 0 : 1;
}

process.exitCode = main(process.argv.slice(2));
