--[[
moonstep.routing -- routing by name, shared by the recipes (ms.routing, in the sandbox too): axolotl's rule for the
parameters that go to AdamW by their names.  (A recipe's own pattern options are matched in the recipe, under
the sandbox's limits: a pattern can cost far more than its length.)
]]
local M = {}

-- axolotl's substrings of the names that go to AdamW: embeddings and heads
local ADAMW_NAMES = { "embed_tokens", "lm_head", "wte", "word_embeddings" }
-- a PEFT head copy, by axolotl's suffix: the matrices inside a saved module (modules_to_save.default.dense.weight)
-- and other adapters' copies are matrices like any other
local PEFT_SAVED_SUFFIX = "modules_to_save.default.weight"

--- Whether axolotl's rule sends the parameter called name to AdamW: it holds embed_tokens, lm_head, wte or
--- word_embeddings, or ends with modules_to_save.default.weight.
function M.adamw_by_name(name)
  if type(name) ~= "string" then error(("routing.adamw_by_name: name must be a string (got %s)"):format(type(name)), 2) end
  for _, s in ipairs(ADAMW_NAMES) do
    if name:find(s, 1, true) then return true end
  end
  return name:sub(-#PEFT_SAVED_SUFFIX) == PEFT_SAVED_SUFFIX
end

return M
