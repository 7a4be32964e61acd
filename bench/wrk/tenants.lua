-- `make bench` (e): every request carries one of N tenant ids (default
-- 10,000: t00000 … t09999, as in the directory bench/run.py generates),
-- picked at random. The requests are formatted once, in init, so wrk's own
-- cost per request stays small.
local requests = {}

function init(args)
  local n = tonumber(args[1]) or 10000
  for i = 0, n - 1 do
    local headers = {}
    for k, v in pairs(wrk.headers) do
      headers[k] = v
    end
    headers["x-tenant-id"] = string.format("t%05d", i)
    requests[i + 1] = wrk.format(nil, nil, headers)
  end
end

function request()
  return requests[math.random(#requests)]
end
