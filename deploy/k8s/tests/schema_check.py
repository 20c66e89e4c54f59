"""Kubernetes objects against the API's JSON schemas of named Kubernetes
versions, from the kubernetes-validate package (tools/python-requirements.txt).

The schemas used are the package's "strict" ones: every object's
additionalProperties is false, so a field the API does not define (a typo
such as `readinesProbe`) fails, which the plain schemas would accept. An
object whose apiVersion and kind have no schema in that version fails too,
where kubernetes-validate's command line would only warn."""

import re

import jsonschema
from kubernetes_validate import utils
from referencing import Registry, Resource

# The manifests need Kubernetes >= 1.24 (native gRPC probes,
# deploy/k8s/README.md): they are checked against the oldest schemas the
# pinned kubernetes-validate ships and against its newest.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")


def problems(obj, version):
    """Every schema violation of `obj` under Kubernetes `version` as
    'PATH: message' lines (empty when it is valid). kubernetes_validate's
    own validate() stops at the first error; this lists them all, with the
    same schemas and validator."""
    if version not in utils.all_versions():
        raise ValueError(f"kubernetes-validate has no schemas for {version}; "
                         f"it has {', '.join(utils.all_versions())}")
    label = (f"{obj.get('kind')}/"
             f"{(obj.get('metadata') or {}).get('name')}")
    try:
        validator = _validator(obj, version)
    except FileNotFoundError:
        return [f"{label}: no schema for {obj.get('apiVersion')} "
                f"{obj.get('kind')} in Kubernetes {version}"]
    except (KeyError, TypeError, AttributeError) as e:
        return [f"{label}: not a Kubernetes object ({e!r})"]
    return [f"{label} /{'/'.join(str(p) for p in e.absolute_path)}: "
            f"{e.message}" for e in validator.iter_errors(obj)]


def _validator(obj, version):
    """The Draft 2020-12 validator kubernetes_validate.validate builds for
    the object's apiVersion and kind from the package's strict schemas.
    FileNotFoundError when the version has no schema for them."""
    api = re.sub(r'^([^./]*)(?:\.[^/]*)?/', r'\1-', obj["apiVersion"])
    schema_dir = f"v{version}-local-strict"
    schema = utils.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/{obj['kind'].lower()}-{api}.json",
        version)
    definitions = utils.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (
        Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema,
                                                      registry=registry)
