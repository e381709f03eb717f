// flowlift's nodes start with their seed's "control after generate" at "fixed".
//
// An upscaler should give the same image when a workflow is run again, and ComfyUI's frontend gives
// every new INT seed widget "randomize" (its node definitions can switch the control on or off, not
// choose its value). This extension sets the control of flowlift's nodes (category "flowlift") to
// "fixed" when a node is created; a saved workflow's own value is applied after this and is kept.
import { app } from "../../scripts/app.js";

const CATEGORY = "flowlift";

app.registerExtension({
  name: "flowlift.FixedSeeds",
  nodeCreated(node) {
    if (node.constructor?.nodeData?.category !== CATEGORY) return;
    for (const widget of node.widgets ?? []) {
      if (widget.name === "control_after_generate") widget.value = "fixed";
    }
  },
});
