#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* 256 -> 64 (11 blocks of 6; last padded) 1x1 NCX, 56x56. order 0: per 64-pixel block, all channels per tile (today's).
   order 1: per range of R pixels, per group of CG channels, per 64-pixel block, per channel block: tile adds CG channels into out. */
static inline void tile(const float*in,size_t S,const float*w,float*out,int nc,int add){
  __m512 acc[6][4]; for(int r=0;r<6;r++)for(int v=0;v<4;v++)acc[r][v]=add?_mm512_loadu_ps(out+r*S+v*16):_mm512_setzero_ps();
  for(int c=0;c<nc;c++){const float*r=in+(size_t)c*S;
    __m512 d0=_mm512_loadu_ps(r),d1=_mm512_loadu_ps(r+16),d2=_mm512_loadu_ps(r+32),d3=_mm512_loadu_ps(r+48);
    for(int k=0;k<6;k++){__m512 b=_mm512_set1_ps(w[c*6+k]);
      acc[k][0]=_mm512_fmadd_ps(d0,b,acc[k][0]);acc[k][1]=_mm512_fmadd_ps(d1,b,acc[k][1]);
      acc[k][2]=_mm512_fmadd_ps(d2,b,acc[k][2]);acc[k][3]=_mm512_fmadd_ps(d3,b,acc[k][3]);}}
  for(int r=0;r<6;r++)for(int v=0;v<4;v++)_mm512_storeu_ps(out+r*S+v*16,acc[r][v]);
}
int main(int argc,char**argv){
  int C=256,S=3136,N=atoi(argv[1]),NB=11,CG=atoi(argv[2]),R=atoi(argv[3]),reps=atoi(argv[4]);
  size_t tot=(size_t)N*C*S; float*a=aligned_alloc(64,tot*4); for(size_t i=0;i<tot;i++)a[i]=1e-3f;
  float*w=aligned_alloc(64,(size_t)C*6*NB*4); for(int i=0;i<C*6*NB;i++)w[i]=1e-3f;
  size_t on=(size_t)N*NB*6*S; float*o=aligned_alloc(64,on*4); for(size_t i=0;i<on;i++)o[i]=0;
  double best[2]={1e9,1e9};
  for(int rep=0;rep<reps;rep++) for(int order=0;order<2;order++){ double t0=now();
    for(int n=0;n<N;n++){ const float*in=a+(size_t)n*C*S; float*out=o+(size_t)n*NB*6*S;
      if(order==0){ for(int p=0;p+64<=S;p+=64) for(int cb=0;cb<NB;cb++) tile(in+p,S,w+(size_t)cb*C*6,out+(size_t)cb*6*S+p,C,0); }
      else if(R<0){ int D=-R; for(int p=0;p+64<=S;p+=64) for(int cb=0;cb<NB;cb++){
             int q=p+64*D; if(q+64<=S){ for(int c=C*cb/NB;c<C*(cb+1)/NB;c++) for(int l=0;l<64;l+=16) if(CG==3)__builtin_prefetch(in+(size_t)c*S+q+l,0,3); else __builtin_prefetch(in+(size_t)c*S+q+l,0,2);}
             tile(in+p,S,w+(size_t)cb*C*6,out+(size_t)cb*6*S+p,C,0);} }
      else for(int r0=0;r0<S;r0+=R){int r1=r0+R<S?r0+R:S; for(int c0=0;c0<C;c0+=CG) for(int p=r0;p+64<=r1;p+=64) for(int cb=0;cb<NB;cb++)
             tile(in+(size_t)c0*S+p,S,w+(size_t)cb*C*6+c0*6,out+(size_t)cb*6*S+p,CG,c0>0);}
    }
    double dt=now()-t0; if(dt<best[order])best[order]=dt;}
  double fl=2.0*N*(S/64*64)*C*6*NB;
  printf("N=%d CG=%d R=%d: today %.1f, groups %.1f GFLOP/s (ratio %.3f)\n",N,CG,R,fl/best[0]/1e9,fl/best[1]/1e9,best[0]/best[1]);
}
