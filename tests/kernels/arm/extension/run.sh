#!/bin/bash
# The whole extension on aarch64 without an ARM machine (issue #22, opt-in; not in .ci/run: it downloads
# ~0.5 GB and takes ~7 minutes on 2 cores). Cross-builds csrc/ for aarch64 with g++-aarch64-linux-gnu and runs
# it under qemu-user with Debian bookworm's aarch64 CPython 3.11 (debs extracted, not installed) and PyPI's
# aarch64 torch 2.13.0 wheel, then checks: the CPU paths qemu's -cpu max / cortex-a76 expose; q4_0, iq4_nl,
# int4_pc in lut4_i8_n16 / q4_4x4 / q4_8x8 bit-identical on every path; the same outputs as this x86 build.
# Needs root (apt: dpkg --add-architecture arm64), qemu-user, g++-aarch64-linux-gnu, and the x86 project
# installed ($PYTHON, default .venv/bin/python). Writes only under $ARMENV (default /tmp/armenv).
#   bash tests/kernels/arm/extension/run.sh      -> exit 0 iff every check passes
set -euo pipefail
A=${ARMENV:-/tmp/armenv}
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/../../../.." && pwd)
PY=${PYTHON:-$MAIN/.venv/bin/python}
PIP="$PY -m pip"
mkdir -p $A/{debs,root,site,obj,pkg,wheels,cudastub,pyinc/aarch64-linux-gnu,scripts}
cp $HERE/*.py $A/scripts/
WHL=$(ls $A/wheels/torch-2.13.0-*aarch64.whl 2>/dev/null || true)
if [ -z "$WHL" ]; then
  $PIP download -q --no-deps -d $A/wheels --platform manylinux_2_28_aarch64 --only-binary=:all: --python-version 3.11 torch==2.13.0
  WHL=$(ls $A/wheels/torch-2.13.0-*aarch64.whl)
fi
T0=$(date +%s)

echo "### 1. aarch64 CPython 3.11 runtime + headers from Debian bookworm arm64 debs (extracted, not installed)"
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
apt-get update -qq
cd $A/debs
for p in python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11 libpython3.11-dev python3.11-dev \
         libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g libffi8 libssl3 libexpat1 libbz2-1.0 liblzma5 libsqlite3-0 \
         libncursesw6 libtinfo6 libreadline8 libuuid1 libcrypt1 libdb5.3 libgdbm6 libgdbm-compat4 libnsl2 libtirpc3 \
         libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1; do
  ls ${p}_*_arm64.deb >/dev/null 2>&1 || apt-get download -q $p:arm64 >/dev/null
done
ls media-types_*_all.deb >/dev/null 2>&1 || apt-get download -q media-types >/dev/null 2>&1 || true
for d in *.deb; do dpkg -x $d $A/root; done
# headers: Python.h + the aarch64 pyconfig.h, without putting the whole arm64 /usr/include on the path
ln -sfn $A/root/usr/include/python3.11 $A/pyinc/python3.11
ln -sfn $A/root/usr/include/aarch64-linux-gnu/python3.11 $A/pyinc/aarch64-linux-gnu/python3.11
# qemu-user 7.2 shows aarch64 guests the host's x86 /proc/cpuinfo, and torch's cpuinfo then segfaults
# (torch.backends.cpu.get_cpu_capability(), any matmul). With -L, qemu opens <prefix>/proc/cpuinfo first if present.
mkdir -p $A/root/proc
python3 - "$A/root/proc/cpuinfo" <<'EOF'
import sys
s = "".join(f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n" for i in range(2))
open(sys.argv[1], "w").write(s)
EOF
cat > $A/qpy.sh <<EOF
#!/bin/sh
# aarch64 python3.11 under qemu-user; QCPU=max|cortex-a76|... picks the emulated CPU (default max)
exec qemu-aarch64 -cpu "\${QCPU:-max}" -L $A/root -E LD_LIBRARY_PATH=$A/cudastub \\
  -E PYTHONPATH=$A/pkg:$A/site -E PYTHONNOUSERSITE=1 -E OMP_NUM_THREADS=\${OMP_NUM_THREADS:-2} \\
  $A/root/usr/bin/python3.11 "\$@"
EOF
chmod +x $A/qpy.sh
QCPU=max $A/qpy.sh -c "import sys, platform, ssl, sqlite3, ctypes, decimal; print(sys.version.split()[0], platform.machine())"

echo "### 2. torch wheel + aarch64/pure-python deps into $A/site"
[ -d $A/site/torch ] || (cd $A/site && unzip -q $WHL)
cd $A/wheels
[ -n "$(ls numpy-*.whl markupsafe-*.whl 2>/dev/null)" ] || $PIP download -q --no-deps -d . --platform manylinux_2_28_aarch64 \
   --only-binary=:all: --python-version 3.11 --implementation cp numpy markupsafe
[ -n "$(ls safetensors-*.whl 2>/dev/null)" ] || $PIP download -q --no-deps -d . --platform manylinux_2_28_aarch64 \
   --platform manylinux_2_17_aarch64 --only-binary=:all: --python-version 3.11 --implementation cp --abi abi3 --abi cp311 safetensors
[ -n "$(ls sympy-*.whl 2>/dev/null)" ] || $PIP download -q --no-deps -d . --only-binary=:all: typing_extensions sympy filelock \
   jinja2 networkx fsspec mpmath setuptools tqdm
for w in *.whl; do case $w in torch-*) ;; *) unzip -qo $w -d $A/site ;; esac; done
# The PyPI aarch64 torch wheel is the CUDA 13 build: libtorch_cpu/libtorch_cuda/libtorch_python need libcudart.so.13,
# libcublas, libcudnn, libnccl, libcupti, ... Instead of ~3 GB of nvidia-* wheels, generate stand-in .so files
# (right SONAME + symbol version + every imported symbol; functions return 100 = cudaErrorNoDevice).
python3 $A/scripts/make_cuda_stubs.py $A/site $A/root $A/cudastub | grep -v '^stub'
T1=$(date +%s)
QCPU=max $A/qpy.sh -c "
import time; t=time.time(); import torch; t=time.time()-t
a=torch.randn(64,64); c=a@a
print('torch', torch.__version__, 'import %.1fs' % t, 'cuda avail', torch.cuda.is_available(), 'cap', torch.backends.cpu.get_cpu_capability(),
      'ABI', torch._C._GLIBCXX_USE_CXX11_ABI, 'mm err', (c-(a.double()@a.double()).float()).abs().max().item())" 2>&1 | grep -v MIDR_EL1

echo "### 3. cross-compile csrc/**/*.cpp -> $A/pkg/torch_lowbit/_C.cpython-311-aarch64-linux-gnu.so"
cat > $A/Makefile <<EOF
# mirrors setup.py on aarch64: -O3 -std=c++17 -fopenmp -Wall -Wno-unused-function -ffp-contract=off (no TORCH_LOWBIT_X86)
SRC    := $MAIN/csrc
WHEEL  := $A/site
OBJDIR := $A/obj
OUT    := $A/pkg/torch_lowbit/_C.cpython-311-aarch64-linux-gnu.so
CXX    := aarch64-linux-gnu-g++
SOURCES := \$(shell cd \$(SRC) && find . -name '*.cpp' | sed 's|^\./||' | sort)
OBJS   := \$(patsubst %.cpp,\$(OBJDIR)/%.o,\$(SOURCES))
CFLAGS := -DNDEBUG -fwrapv -Wsign-compare -fPIC -I\$(SRC) -I\$(WHEEL)/torch/include -I\$(WHEEL)/torch/include/torch/csrc/api/include \\
          -I$A/pyinc/python3.11 -I$A/pyinc \\
          -O3 -std=c++17 -fopenmp -Wall -Wno-unused-function -ffp-contract=off \\
          -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1
all: \$(OUT)
\$(OBJDIR)/%.o: \$(SRC)/%.cpp
	@mkdir -p \$(dir \$@)
	@/usr/bin/time -f "  %e s  \$<" \$(CXX) -MMD \$(CFLAGS) -c \$< -o \$@
\$(OUT): \$(OBJS)
	@mkdir -p \$(dir \$@)
	\$(CXX) -shared -fopenmp -o \$@ \$(OBJS) -L\$(WHEEL)/torch/lib -lc10 -ltorch -ltorch_cpu -ltorch_python -Wl,--allow-shlib-undefined
-include \$(OBJS:.o=.d)
EOF
# 4. the Python package (without the x86 _C .so and caches)
mkdir -p $A/pkg && tar -C $MAIN --exclude='__pycache__' --exclude='_C.cpython-311-x86_64-linux-gnu.so' -cf - torch_lowbit | tar -C $A/pkg -xf -
TB=$(date +%s)
if ! make -C $A -j2 > $A/build.log 2>&1; then tail -60 $A/build.log; echo "BUILD FAILED"; exit 1; fi
grep -E "^  [0-9.]+ s|warning: unused" $A/build.log || true   # per-file compile seconds (only files rebuilt this time)
echo "build: $(( $(date +%s) - TB )) s"
aarch64-linux-gnu-readelf -d $A/pkg/torch_lowbit/_C.cpython-311-aarch64-linux-gnu.so | grep NEEDED | tr -s ' ' | cut -d' ' -f6 | tr '\n' ' '; echo

cd $A
for cpu in max cortex-a76; do
  echo "### 4. -cpu $cpu: import torch_lowbit, available_cpu_paths"; QCPU=$cpu ./qpy.sh -X faulthandler scripts/check_paths.py 2>&1 | grep -v MIDR_EL1
done
for cpu in max cortex-a76; do
  echo "### 5. -cpu $cpu: q4_0/iq4_nl/int4_pc x lut4_i8_n16/q4_4x4/q4_8x8 x every cpu path, bit-identical?"
  QCPU=$cpu ./qpy.sh -X faulthandler scripts/check_layouts.py 2>&1 | grep -v MIDR_EL1 | tee $A/layouts_$cpu.log
done
echo "### extra: aarch64 (-cpu max) vs this x86 machine's build in $MAIN, same inputs"
(cd /tmp && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$MAIN $PY $A/scripts/cross_arch.py $A/out_x86.pt)
QCPU=max ./qpy.sh scripts/cross_arch.py $A/out_arm.pt $A/out_x86.pt 2>&1 | grep -v MIDR_EL1
(cd /tmp && PYTHONDONTWRITEBYTECODE=1 $PY $A/scripts/compare_arch.py $A/out_x86.pt $A/out_arm.pt) | tee $A/cross.log
echo "total: $(( $(date +%s) - T0 )) s"
grep -q "ALL OK" $A/layouts_max.log && grep -q "ALL OK" $A/layouts_cortex-a76.log && grep -q "CROSS-ARCH OK" $A/cross.log \
  && echo "ARM EXTENSION OK" || { echo "ARM EXTENSION CHECK FAILED"; exit 1; }
