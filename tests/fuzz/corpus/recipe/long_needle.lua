local s, p = ('a'):rep(2^21), ('a'):rep(2^19) .. 'b'
s:find(p, 1, true)
return {}
