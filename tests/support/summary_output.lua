-- busted output: the plain terminal report, plus the counts written to $MS_TEST_SUMMARY for tests/run.sh
return function(options)
  local busted = require("busted")
  local handler = require("busted.outputHandlers.plainTerminal")(options)
  busted.subscribe({ "suite", "end" }, function()
    local path = os.getenv("MS_TEST_SUMMARY")
    if path then
      local f = assert(io.open(path, "w"))
      f:write(("%d %d %d\n"):format(handler.successesCount, handler.failuresCount + handler.errorsCount,
                                   handler.pendingsCount))
      f:close()
    end
    return nil, true
  end)
  return handler
end
