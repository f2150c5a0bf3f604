# moonstep -- build, test, install.
#
#   make              build/libmoonstep.so and build/moonstep (and the CUDA backend when nvcc is found)
#   make test         the whole suite (C tests + busted specs); ends with "N passed, N failed[, N skipped]"
#   make run          the main job: compare the SinkGD, AdamW and DASH recipes (those present) on the lm problem
#   make memcheck     the suite with AddressSanitizer + LeakSanitizer (build-asan/)
#   make install PREFIX=/usr/local
#
# Knobs: CUDA=auto|0|1  NCCL=auto|0|1 (communicators; with CUDA only)  NVTX=1|0  PREFIX=/usr/local  BUILD=build  SANITIZE=address  V=1 (echo commands)

# ------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------
CC       ?= gcc
CUDA     ?= auto
PREFIX   ?= /usr/local
BUILD    ?= build
SANITIZE ?=
NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))

VERSION  := $(shell sed -n 's/^\#define MS_VERSION_STRING "\(.*\)"/\1/p' engine/include/moonstep.h)
ABI      := $(shell sed -n 's/^\#define MS_ABI_VERSION \([0-9]*\)/\1/p' engine/include/moonstep.h)
SONAME   := libmoonstep.so.$(ABI)
REAL     := $(SONAME).$(VERSION)

ifneq ($(filter $(CUDA),auto 0 1),$(CUDA))
$(error CUDA must be auto, 0 or 1 (got '$(CUDA)'))
endif
ifeq ($(CUDA),auto)
WITH_CUDA := $(if $(NVCC),1,0)
else
WITH_CUDA := $(CUDA)
endif
ifeq ($(wildcard engine/cuda/*.c engine/cuda/*.cu kernels/*.cu),)
WITH_CUDA := 0
endif
ifeq ($(WITH_CUDA)$(NVCC),1)
$(error CUDA=1 but nvcc was not found (set NVCC=/path/to/nvcc))
endif

Q := $(if $(V),,@)
E := $(if $(V),@true,@printf '  %-6s %s\n')

# NCCL (communicators, engine/cuda/comm.c): found beside the CUDA toolkit or in the system's folders
NCCL ?= auto
ifneq ($(filter $(NCCL),auto 0 1),$(NCCL))
$(error NCCL must be auto, 0 or 1 (got '$(NCCL)'))
endif
NCCL_HEADER := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
NCCL_LIBDIR := $(patsubst %/,%,$(dir $(firstword $(wildcard $(CUDA_HOME)/lib/libnccl.so $(CUDA_HOME)/lib64/libnccl.so \
                 /usr/lib/x86_64-linux-gnu/libnccl.so /usr/lib64/libnccl.so))))
WITH_NCCL := 0
ifeq ($(WITH_CUDA),1)
ifeq ($(NCCL),auto)
WITH_NCCL := $(if $(and $(NCCL_HEADER),$(NCCL_LIBDIR)),1,0)
else
WITH_NCCL := $(NCCL)
endif
endif
ifeq ($(WITH_NCCL)$(NCCL_HEADER)$(NCCL_LIBDIR),1)
$(error NCCL=1 but nccl.h or libnccl.so was not found (looked in $(CUDA_HOME) and /usr))
endif

LUAJIT_CFLAGS := $(shell pkg-config --cflags luajit 2>/dev/null || echo -I/usr/include/luajit-2.1)
LUAJIT_LIBS   := $(shell pkg-config --libs luajit 2>/dev/null || echo -lluajit-5.1)
HAVE_READLINE := $(shell test -f /usr/include/readline/readline.h && echo 1 || echo 0)

$(info moonstep $(VERSION) (abi $(ABI)): CC=$(CC), CUDA=$(CUDA) -> $(if $(filter 1,$(WITH_CUDA)),with CUDA ($(NVCC)),CPU only), NCCL=$(NCCL) -> $(if $(filter 1,$(WITH_NCCL)),with NCCL ($(NCCL_LIBDIR)),no NCCL), readline=$(HAVE_READLINE)$(if $(SANITIZE), sanitize=$(SANITIZE)))

# ------------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------------
SAN_FLAGS := $(if $(SANITIZE),-fsanitize=$(SANITIZE) -fno-omit-frame-pointer,)
OPT       := $(if $(SANITIZE),-O1 -g,-O2 -g)
CFLAGS_ALL := -std=c11 $(OPT) -fPIC -fopenmp -Wall -Wextra -D_GNU_SOURCE -MMD -MP $(SAN_FLAGS) \
              -Iengine/include -Iengine/core -I$(BUILD)/gen
# LuaJIT: the embedding API (engine/core/embed.c) runs recipes in a Lua state of its own
LIB_CFLAGS := $(CFLAGS_ALL) -fvisibility=hidden -DMS_BUILDING_LIBRARY $(LUAJIT_CFLAGS)
LIB_LIBS   := -lopenblas -llapacke -lm -fopenmp $(LUAJIT_LIBS) -ldl
NVCCFLAGS  := -O3 -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden -DMS_BUILDING_LIBRARY -DMS_WITH_CUDA \
              -Iengine/include -Iengine/core -Ikernels -gencode arch=compute_90,code=[sm_90,compute_90]

ifeq ($(WITH_CUDA),1)
LIB_CFLAGS += -DMS_WITH_CUDA -I$(CUDA_HOME)/include -Ikernels
LIB_LIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcublasLt -lcusolver -lcudart -lstdc++
endif
ifeq ($(WITH_NCCL),1)
LIB_CFLAGS += -DMS_WITH_NCCL -I$(dir $(NCCL_HEADER))
LIB_LIBS   += -L$(NCCL_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) -lnccl
endif

# NVTX v3 profiler ranges (header-only, in the CUDA toolkit; no library to link); NVTX=0 leaves them out
NVTX ?= 1
NVTX_HEADER :=
ifeq ($(WITH_CUDA)$(NVTX),11)
NVTX_HEADER := $(wildcard $(CUDA_HOME)/include/nvtx3/nvToolsExt.h)
$(info   NVTX ranges: $(if $(NVTX_HEADER),yes ($(NVTX_HEADER)),no (no nvtx3/nvToolsExt.h under $(CUDA_HOME)/include)))
endif
ifneq ($(NVTX_HEADER),)
LIB_CFLAGS += -DMS_WITH_NVTX
endif

# ------------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------------
CORE_SRC := $(wildcard engine/core/*.c)
CPU_SRC  := $(wildcard engine/cpu/*.c)
CUDA_C   := $(if $(filter 1,$(WITH_CUDA)),$(wildcard engine/cuda/*.c),)
CUDA_CU  := $(if $(filter 1,$(WITH_CUDA)),$(wildcard kernels/*.cu engine/cuda/*.cu),)
LIB_OBJ  := $(patsubst %.c,$(BUILD)/obj/%.o,$(CORE_SRC) $(CPU_SRC) $(CUDA_C)) \
            $(patsubst %.cu,$(BUILD)/obj/%.o,$(CUDA_CU))
CTESTS   := $(patsubst tests/c/%.c,$(BUILD)/tests/%,$(wildcard tests/c/test_*.c))
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))

LIB      := $(BUILD)/libmoonstep.so
HOST     := $(BUILD)/moonstep

.PHONY: all lib host tests test check run memcheck install uninstall clean deps cdef examples bench-c
all: lib host

deps: $(BUILD)/.deps-ok
$(BUILD)/.deps-ok: scripts/setup-deps.sh
	$(Q)mkdir -p $(BUILD)
	$(Q)sh scripts/setup-deps.sh
	$(Q)touch $@

lib: $(LIB)
host: $(HOST)

$(BUILD)/gen/cdef.inc: engine/include/moonstep.h scripts/gen-cdef.sh
	$(E) GEN $@
	$(Q)sh scripts/gen-cdef.sh $(firstword $(CC)) $< $(BUILD)/gen

$(BUILD)/obj/engine/core/version.o: $(BUILD)/gen/cdef.inc

$(BUILD)/obj/%.o: %.c | $(BUILD)/.deps-ok
	$(E) CC $<
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(LIB_CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	$(E) NVCC $<
	$(Q)mkdir -p $(dir $@)
	$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/$(REAL): $(LIB_OBJ)
	$(E) LD $@
	$(Q)$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--no-undefined -Wl,-z,nodelete $(SAN_FLAGS) -o $@ $(LIB_OBJ) $(LIB_LIBS)

$(LIB): $(BUILD)/$(REAL)
	$(Q)ln -sf $(notdir $<) $(BUILD)/$(SONAME)
	$(Q)ln -sf $(SONAME) $@

$(HOST): engine/host/main.c $(LIB)
	$(E) CC $@
	$(Q)mkdir -p $(BUILD)/obj/engine/host
	$(Q)$(CC) $(CFLAGS_ALL) $(LUAJIT_CFLAGS) -DMS_HAVE_READLINE=$(HAVE_READLINE) -c $< -o $(BUILD)/obj/engine/host/main.o
	$(Q)$(CC) $(SAN_FLAGS) -o $@ $(BUILD)/obj/engine/host/main.o -L$(BUILD) -lmoonstep \
	    -Wl,-rpath,'$$ORIGIN' -Wl,-rpath,'$$ORIGIN/../lib' $(LUAJIT_LIBS) $(if $(filter 1,$(HAVE_READLINE)),-lreadline,) -ldl -lm

# C tests link the engine's objects directly (internal symbols are hidden in the .so)
$(BUILD)/tests/%: tests/c/%.c tests/c/check.h $(LIB_OBJ)
	$(E) CC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS_ALL) -DMS_BUILDING_LIBRARY -Itests/c -Iengine/cpu $< $(LIB_OBJ) -o $@ $(LIB_LIBS)

# Programs that use moonstep as a trainer does, through libmoonstep.so (found beside them at run time): the
# embedding API's Lua side loads the library that holds it, which must be the one they call
EMBED_CC   = $(CC) -std=c11 $(OPT) -Wall -Wextra -D_GNU_SOURCE $(SAN_FLAGS) -Iengine/include -Itests/c
EMBED_LINK = -L$(BUILD) -lmoonstep -Wl,-rpath,'$$ORIGIN/..' -lm
$(BUILD)/tests/test_embed: tests/c/test_embed.c tests/c/check.h $(LIB)
	$(E) CC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(EMBED_CC) $< -o $@ $(EMBED_LINK)

# examples/*.c -> $(BUILD)/examples/ (run by tests/embed_spec.lua)
examples: $(EXAMPLES)
$(BUILD)/examples/%: examples/%.c $(LIB)
	$(E) CC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(EMBED_CC) $< -o $@ $(EMBED_LINK)

# ------------------------------------------------------------------------------------------------------
# Tests, demo, sanitizers
# ------------------------------------------------------------------------------------------------------
test: all $(CTESTS) $(EXAMPLES)
	$(Q)MOONSTEP_BUILD=$(BUILD) sh tests/run.sh

# the C test programs alone (build them here before carrying build/ to a host that cannot compile)
tests: all $(CTESTS) $(EXAMPLES)

# the C host-overhead bench through the embedding API (bench/overhead_c.c), and with CUDA the survey of the
# DASH solvers' batched GEMMs (bench/gemm_survey.cu, cuBLAS alone) and the SinkGD experiments (one warp a row:
# bench/rowwarp_sweep.cu; more warps an SM: bench/lane_sweep.cu; a cluster per matrix with G on chip:
# bench/cluster_sinkhorn.cu; a bare read timed per SM: bench/sm_balance.cu); run them on the GPU host
bench-c: $(BUILD)/bench/overhead_c $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/bench/gemm_survey $(BUILD)/bench/rowwarp_sweep $(BUILD)/bench/lane_sweep $(BUILD)/bench/cluster_sinkhorn $(BUILD)/bench/sm_balance)
$(BUILD)/bench/overhead_c: bench/overhead_c.c $(LIB)
	$(E) CC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS_ALL) $< -o $@ -L$(BUILD) -lmoonstep -Wl,-rpath,'$$ORIGIN/..'
$(BUILD)/bench/gemm_survey: bench/gemm_survey.cu
	$(E) NVCC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(NVCC) -O2 -gencode arch=compute_90,code=[sm_90,compute_90] $< -o $@ -L$(CUDA_HOME)/lib64 \
	    -Xlinker -rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas
$(BUILD)/bench/rowwarp_sweep $(BUILD)/bench/lane_sweep $(BUILD)/bench/cluster_sinkhorn $(BUILD)/bench/sm_balance: $(BUILD)/bench/%: bench/%.cu bench/standalone.cuh
	$(E) NVCC $@
	$(Q)mkdir -p $(dir $@)
	$(Q)$(NVCC) -O3 -std=c++17 -gencode arch=compute_90,code=[sm_90,compute_90] $< -o $@

# the suite on an existing build, without rebuilding (a GPU host that received a carried build/)
check:
	$(Q)MOONSTEP_BUILD=$(BUILD) sh tests/run.sh

# the lm problem trained with each recipe on the best device found; the table, and the plot in $(BUILD)/run/
run: all
	$(Q)$(HOST) compare --problem lm --recipes sinkgd,adamw,dash --skip-missing --out $(BUILD)/run

memcheck:
	$(Q)$(MAKE) --no-print-directory BUILD=build-asan SANITIZE=address CUDA=0 all \
	    $(patsubst $(BUILD)/%,build-asan/%,$(CTESTS) $(EXAMPLES))
	$(Q)MOONSTEP_BUILD=build-asan MOONSTEP_ASAN=1 sh tests/run.sh

# ------------------------------------------------------------------------------------------------------
# Install
# ------------------------------------------------------------------------------------------------------
LUADIR := $(PREFIX)/share/lua/5.1
install: all
	$(E) INSTALL $(PREFIX)
	$(Q)install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin \
	    $(DESTDIR)$(LUADIR)/moonstep $(DESTDIR)$(PREFIX)/share/moonstep/recipes $(DESTDIR)$(PREFIX)/lib/pkgconfig
	$(Q)install -m 755 $(BUILD)/$(REAL) $(DESTDIR)$(PREFIX)/lib/
	$(Q)ln -sf $(REAL) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	$(Q)ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libmoonstep.so
	$(Q)install -m 644 engine/include/moonstep.h $(DESTDIR)$(PREFIX)/include/
	$(Q)install -m 755 $(HOST) $(DESTDIR)$(PREFIX)/bin/
	$(Q)install -m 644 lua/moonstep/*.lua $(DESTDIR)$(LUADIR)/moonstep/
	$(Q)install -d $(DESTDIR)$(LUADIR)/moonstep/problems
	$(Q)install -m 644 lua/moonstep/problems/*.lua $(DESTDIR)$(LUADIR)/moonstep/problems/
	$(Q)for f in recipes/*.lua; do [ -e "$$f" ] && install -m 644 "$$f" $(DESTDIR)$(PREFIX)/share/moonstep/recipes/; done; true
	$(Q)sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' scripts/moonstep.pc.in \
	    > $(DESTDIR)$(PREFIX)/lib/pkgconfig/moonstep.pc

uninstall:
	$(Q)rm -rf $(DESTDIR)$(PREFIX)/lib/libmoonstep.so* $(DESTDIR)$(PREFIX)/include/moonstep.h \
	    $(DESTDIR)$(PREFIX)/bin/moonstep $(DESTDIR)$(LUADIR)/moonstep $(DESTDIR)$(PREFIX)/share/moonstep \
	    $(DESTDIR)$(PREFIX)/lib/pkgconfig/moonstep.pc

clean:
	$(Q)rm -rf $(BUILD) build-asan $(FUZZ_BUILD)

# ------------------------------------------------------------------------------------------------------
# Fuzzing: libFuzzer harnesses (tests/fuzz/) with ASan + UBSan, built with clang into build-fuzz/.
#   make fuzz [FUZZ_SECONDS=60]   each harness for FUZZ_SECONDS, from its committed corpus
#                                 (tests/fuzz/corpus/<name>/); new inputs go to build-fuzz/corpus/<name>/
# ------------------------------------------------------------------------------------------------------
FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang
FUZZ_BUILD   := build-fuzz
FUZZ_NAMES   := json safetensors checkpoint recipe
FUZZ_OBJ     := $(patsubst %.c,$(FUZZ_BUILD)/obj/%.o,$(CORE_SRC) $(CPU_SRC))
FUZZ_SAN     := -fsanitize=address,undefined -fno-omit-frame-pointer
# the Lua harnesses keep one LuaJIT state alive to the end, whose garbage is freed whenever its collector
# runs: leak checks there would only report that state
FUZZ_NOLEAKS := checkpoint recipe

.PHONY: fuzz fuzz-build
fuzz-build:
	$(Q)sh scripts/setup-deps.sh --fuzz
	$(Q)$(MAKE) -s --no-print-directory BUILD=$(FUZZ_BUILD) CC="$(FUZZ_CC) -Wno-pass-failed" CUDA=0 \
	    SANITIZE=address,undefined,fuzzer-no-link $(FUZZ_OBJ)
	$(Q)$(MAKE) -s --no-print-directory CUDA=0 $(FUZZ_BUILD)/libmoonstep-fuzz.so $(patsubst %,$(FUZZ_BUILD)/fuzz_%,$(FUZZ_NAMES))

# Linked here rather than by the library rule: a clang-sanitized shared library takes its sanitizer
# runtime from the executable that loads it (the harness), so it must not be linked with --no-undefined.
$(FUZZ_BUILD)/libmoonstep-fuzz.so: $(FUZZ_OBJ)
	$(E) LD $@
	$(Q)$(FUZZ_CC) -shared $(FUZZ_SAN) -o $@ $(FUZZ_OBJ) $(LIB_LIBS)

$(FUZZ_BUILD)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/lua_harness.h $(FUZZ_OBJ)
	$(E) FUZZCC $@
	$(Q)$(FUZZ_CC) -std=c11 -O1 -g -fsanitize=fuzzer $(FUZZ_SAN) -D_GNU_SOURCE -Iengine/include -Iengine/core \
	    $(LUAJIT_CFLAGS) -DMS_SOURCE_DIR='"$(CURDIR)"' -DMS_FUZZ_BUILD='"$(FUZZ_BUILD)"' $< $(FUZZ_OBJ) -o $@ \
	    $(LIB_LIBS) $(LUAJIT_LIBS) -ldl

fuzz: fuzz-build
	$(Q)for n in $(FUZZ_NAMES); do \
	    mkdir -p $(FUZZ_BUILD)/corpus/$$n; \
	    printf '  %-6s %s (%s s)\n' FUZZ $$n $(FUZZ_SECONDS); \
	    leaks=1; case " $(FUZZ_NOLEAKS) " in *" $$n "*) leaks=0;; esac; \
	    ASAN_OPTIONS=detect_leaks=$$leaks UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	    $(FUZZ_BUILD)/fuzz_$$n -max_total_time=$(FUZZ_SECONDS) -detect_leaks=$$leaks \
	        -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/ \
	        $(FUZZ_BUILD)/corpus/$$n tests/fuzz/corpus/$$n 2>&1 | grep -E '^(#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|==[0-9]+==|SUMMARY|fuzz finding|.*runtime error)' ; \
	    [ -z "$$(ls $(FUZZ_BUILD)/crash-* $(FUZZ_BUILD)/leak-* $(FUZZ_BUILD)/timeout-* 2>/dev/null)" ] || exit 1; \
	done

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
