return {
  name = "keeper", versioo = 1,
  options = { lr = { default = 0.1, type = "number" } },
  route = function(p, o) return "r" end,
  routes = { r = { step = function(group, o, ctx) kept =-ms.zeros({78%3}) end } },
}
