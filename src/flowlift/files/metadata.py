"""flowlift's output metadata: one layout for every writer (docs/metadata.md), and the older layouts read into it.

Schema 1, written by ``upscale``, ``colorfix``, ``img2img``, ``hires`` (and so by the web app and the Python API,
which run the same per-image steps): two PNG text chunks (one JSON object in a JPEG/WebP EXIF UserComment or a TIFF
ImageDescription)::

    Software   flowlift <version> <command>
    flowlift   {"schema": 1, "flowlift": "<version>", "command": "<command>", "input": "<name>",
                "input_sha256": "<hex>", ...the command's own fields}

:func:`metadata_record` builds it; :func:`as_current` turns what an older file holds into the same keys: the
upscale/colorfix layout before it (``flowlift.parameters``, ``flowlift.models``, ``flowlift.source``,
``flowlift.reference`` chunks) and the refine layout (one ``flowlift`` chunk without ``schema`` or ``Software``).
"""

from __future__ import annotations

from collections.abc import Mapping

#: The version of the layout :func:`metadata_record` writes.
METADATA_SCHEMA = 1
#: The chunks of the upscale/colorfix layout before schema 1.
OLD_CHUNKS = ("flowlift.parameters", "flowlift.models", "flowlift.source", "flowlift.reference")


def metadata_record(command: str, fields: Mapping[str, object]) -> dict[str, object]:
    """The metadata of one output of ``command``: ``Software`` and the ``flowlift`` object (``schema``, the
    version, the command, then ``fields``; a field of None is left out)."""
    from flowlift.version import __version__

    record: dict[str, object] = {"schema": METADATA_SCHEMA, "flowlift": __version__, "command": command}
    record.update({key: value for key, value in fields.items() if value is not None and key not in record})
    return {"Software": f"flowlift {__version__} {command}", "flowlift": record}


def _software(text: object) -> tuple[str | None, str | None]:
    """(version, command) of a ``Software`` value ``flowlift <version> <command>``."""
    parts = text.split() if isinstance(text, str) else []
    if len(parts) >= 2 and parts[0] == "flowlift":
        return parts[1], parts[2] if len(parts) > 2 else None
    return None, None


def as_current(metadata: dict[str, object]) -> dict[str, object]:
    """``metadata`` (what :func:`flowlift.files.image_outputs.read_metadata` decoded) with the schema-1 keys filled in
    from an older layout; a schema-1 file or a file of another program is returned as it is."""
    record = metadata.get("flowlift")
    if isinstance(record, dict) and "schema" in record:
        return metadata
    version, command = _software(metadata.get("Software"))
    if isinstance(record, dict):  # the refine layout: one object with the version and the command, no Software
        version, command = record.get("flowlift", version), record.get("command", command)
        fields = {key: value for key, value in record.items() if key not in ("flowlift", "command")}
    elif any(key in metadata for key in OLD_CHUNKS):  # the upscale/colorfix chunks
        parameters = metadata.get("flowlift.parameters")
        fields = dict(parameters) if isinstance(parameters, dict) else {}
        for role, key in (("input", "flowlift.source"), ("reference", "flowlift.reference")):
            found = metadata.get(key)
            if isinstance(found, dict):
                fields[role], fields[f"{role}_sha256"] = found.get("name"), found.get("sha256")
        if isinstance(metadata.get("flowlift.models"), dict):
            fields["models"] = metadata["flowlift.models"]
    else:
        return metadata
    current = dict(metadata)
    current["flowlift"] = {
        "schema": METADATA_SCHEMA,
        "flowlift": version,
        "command": command,
        **{key: value for key, value in fields.items() if value is not None},
    }
    current.setdefault("Software", f"flowlift {version} {command}")
    return current
